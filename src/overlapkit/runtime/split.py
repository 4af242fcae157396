"""How the ``partition`` policy divides a rank's cores: the arithmetic alone, from
what the optimizations declare and what the profile measured (no threads, no
/proc; `partition` applies it)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .optimization import Demand

COMPUTE = "compute"


@dataclass(frozen=True)
class Profile:
    """What the first steps measured, per step: the wall time, the CPU time the
    background work needs and the CPU time compute used (this process's, less
    its background threads'). Loader workers run ahead of the step or fall
    behind it, so theirs is their CPU time per sample loaded times the samples
    a step takes; the other threads' is their CPU time over the steps."""

    steps: int
    step_s: float
    background_cpu_s: float
    compute_cpu_s: float
    loader_cpu_s_per_sample: float | None = None

    @property
    def background_share(self) -> float:
        """The background's part of the CPU time the rank uses. It does not depend
        on how long the steps took: contention that slows them (the reason to
        divide the cores) leaves it as it is."""
        total = self.background_cpu_s + self.compute_cpu_s
        return self.background_cpu_s / total if total > 0 else 0.0


@dataclass(frozen=True)
class Split:
    """The rank's cores, and which of them compute and each background consumer use."""

    cores: tuple[int, ...]
    compute: tuple[int, ...]
    background: tuple[int, ...]  # the background's own cores (may be none)
    compute_threads: int
    consumers: dict[str, tuple[int, ...]] = field(default_factory=dict)  # background ones
    basis: str = "declared"  # declared, profiled, set (by a knob or world.threads)
    profile: Profile | None = None

    def cores_of(self, consumer: str) -> tuple[int, ...]:
        return self.compute if consumer == COMPUTE else self.consumers.get(consumer, self.compute)

    def shares_compute(self, consumer: str) -> bool:
        return bool(set(self.cores_of(consumer)) & set(self.compute))

    def as_dict(self) -> dict[str, Any]:
        out = {
            "cores": list(self.cores),
            "compute": list(self.compute),
            "compute_threads": self.compute_threads,
            "background": list(self.background),
            "consumers": {name: list(c) for name, c in self.consumers.items()},
            "basis": self.basis,
        }
        if self.profile is not None:
            share = self.profile.background_share
            out["profile"] = {
                **asdict(self.profile),
                "background_share": share,
                "background_cores_wanted": share * len(self.cores),
            }
        return out


def size_split(
    cores: list[int],
    demands: list[Demand],
    *,
    threads: int | None = None,
    background_cores: int | None = None,
    spill: bool = True,
    profile: Profile | None = None,
) -> Split:
    """Divide ``cores``: the background keeps ``background_cores`` of its own if set,
    else what ``threads`` (world.threads) leaves, else its share of the CPU time
    in the ``profile`` times the cores (rounded), else none (the declared split).
    Compute always keeps at least one core, and the background never more cores
    than its threads. Without cores of its own, or with ``spill``, the background
    also runs on the compute cores."""
    n = len(cores)
    wanted = sum(d.threads for d in demands)
    if background_cores is not None:
        basis, own = "set", background_cores
    elif threads is not None:
        basis, own = "set", n - threads
    elif profile is not None:
        basis, own = "profiled", math.floor(profile.background_share * n + 0.5)
    else:
        basis, own = "declared", 0
    own = max(0, min(own, n - 1, wanted))
    compute = tuple(cores[: n - own])
    background = tuple(cores[n - own :])
    shared = spill or not background
    places = tuple(sorted(set(background) | (set(compute) if shared else set())))
    consumers = {d.consumer: places for d in demands if d.threads}
    return Split(
        cores=tuple(cores),
        compute=compute,
        background=background,
        compute_threads=threads if threads is not None else len(compute),
        consumers=consumers,
        basis=basis,
        profile=profile,
    )
