"""A profile of all-reduce calls by message size, like the tables MPI/Horovod profilers print."""

from __future__ import annotations

import math
import statistics
from typing import Any

MIB = 1 << 20
SIZE_CLASSES: tuple[tuple[float, str], ...] = (
    (128 * 1024, "<=128KiB"),
    (16 * MIB, "128KiB-16MiB"),
    (32 * MIB, "16-32MiB"),
    (64 * MIB, "32-64MiB"),
    (math.inf, ">64MiB"),
)


def size_class(nbytes: int) -> str:
    return next(name for limit, name in SIZE_CLASSES if nbytes <= limit)


class AllreduceProfile:
    """Count, bytes and latency of all-reduce calls, per size class."""

    def __init__(self) -> None:
        self._calls: dict[str, list[tuple[int, float]]] = {name: [] for _, name in SIZE_CLASSES}

    def add(self, nbytes: int, latency_s: float) -> None:
        self._calls[size_class(nbytes)].append((nbytes, latency_s))

    @property
    def calls(self) -> int:
        return sum(len(c) for c in self._calls.values())

    def summary(self) -> list[dict[str, Any]]:
        rows = []
        for name, calls in self._calls.items():
            latencies = [latency for _, latency in calls]
            rows.append(
                {
                    "size_class": name,
                    "calls": len(calls),
                    "bytes": sum(nbytes for nbytes, _ in calls),
                    "latency_ms_mean": statistics.fmean(latencies) * 1e3 if calls else 0.0,
                    "latency_ms_p50": statistics.median(latencies) * 1e3 if calls else 0.0,
                    "latency_ms_max": max(latencies) * 1e3 if calls else 0.0,
                    "bandwidth_mib_s": (
                        sum(n for n, _ in calls) / sum(latencies) / MIB
                        if calls and sum(latencies) > 0
                        else 0.0
                    ),
                }
            )
        return rows

    def table(self, title: str) -> dict[str, Any]:
        """The profile as a table for the run's printed summary."""
        return {
            "title": title,
            "columns": ["size class", "calls", "MiB", "mean ms", "p50 ms", "max ms", "MiB/s"],
            "rows": [
                [
                    r["size_class"],
                    r["calls"],
                    f"{r['bytes'] / MIB:.1f}",
                    f"{r['latency_ms_mean']:.2f}",
                    f"{r['latency_ms_p50']:.2f}",
                    f"{r['latency_ms_max']:.2f}",
                    f"{r['bandwidth_mib_s']:.0f}",
                ]
                for r in self.summary()
                if r["calls"]
            ],
        }
