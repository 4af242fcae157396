"""A simulated machine for tuning tests: a trial's throughput is its setting's true
value, times the machine's speed when it runs (a known trend, seeded noise), with
no process started. It answers as `overlapkit.tuning.trial.run_trial` does: a run
summary, with the checkpoint's measured cost when the setting checkpoints."""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

BATCH = 32  # samples a step


def contend_truth(data: dict[str, Any]) -> float:
    """True samples/s of a setting of a small contention space (ddp_overlap and
    prefetch intensities, the policy): prefetch pays at 0.5 only under partition,
    ddp_overlap pays at 0.5 and 1 alike, all on at full under free contends."""
    opts = data.get("optimizations") or {}
    policy = (data.get("scheduler") or {}).get("policy", "free")
    ddp = (opts.get("ddp_overlap") or {}).get("intensity", 0.0) if "ddp_overlap" in opts else 0.0
    fetch = (opts.get("prefetch") or {}).get("intensity", 0.0) if "prefetch" in opts else 0.0
    value = 500.0
    value *= {0.0: 1.0, 0.5: 1.06, 1.0: 1.06}[ddp]
    if policy == "partition":
        value *= {0.0: 1.0, 0.5: 1.10, 1.0: 1.02}[fetch]
    else:
        value *= {0.0: 1.0, 0.5: 0.97, 1.0: 0.90}[fetch]
    if policy == "priority":
        value *= 0.99
    return value


class SimulatedMachine:
    """``truth(scenario data) -> samples/s``; the machine's speed at its n-th trial
    is exp(``trend`` x n) x exp(N(0, ``noise``)), seeded; a setting that checkpoints
    pays ``cost_s`` per checkpoint (its measured cost, with a small error), measured
    only when its interval exceeds ``persist_steps`` (else no step runs clean)."""

    def __init__(
        self,
        truth: Callable[[dict[str, Any]], float],
        trend: float = 0.0,
        noise: float = 0.02,
        seed: int = 0,
        cost_s: float = 0.01,
        slow: Callable[[int], float] | None = None,
        persist_steps: int = 0,
    ) -> None:
        self.truth, self.trend, self.noise = truth, trend, noise
        self.slow = slow or (lambda n: 1.0)  # an extra factor at the n-th trial
        self.cost_s = cost_s
        self.persist_steps = persist_steps  # a persist's length: no step is clean below it
        self.random = random.Random(seed)
        self.trials = 0
        self.ran: list[tuple[int, dict[str, Any], float]] = []  # (n, data, samples/s)
        self._lock = threading.Lock()

    def speed(self, n: int) -> float:
        return math.exp(self.trend * n) * self.slow(n)

    def __call__(
        self,
        data: dict[str, Any],
        folder: Path,
        timeout_s: float,
        on_step: Callable[[int, float], bool] | None = None,
        **where: Any,
    ) -> dict[str, Any]:
        with self._lock:
            n = self.trials
            self.trials += 1
            noise = math.exp(self.random.gauss(0.0, self.noise))
        steps = data["train"]["steps"]
        rate = self.truth(data) * self.speed(n) * noise
        step_s = BATCH / rate
        summary: dict[str, Any] = {
            "steps": steps,
            "samples_per_s": rate,
            "step_time_s": {"mean": step_s, "p50": step_s, "p90": step_s, "se_rel": 0.01},
            "phase_shares": {"forward": 0.5, "backward": 0.4, "other": 0.1},
            "scheduler": {},
            "optimizations": {},
        }
        checkpoint = (data.get("optimizations") or {}).get("checkpoint")
        if checkpoint is not None:
            every = checkpoint["every"]
            taken = steps // every
            if 2 * every <= steps:  # its cost falls inside the measured steps
                rate = BATCH / (step_s + self.cost_s / every)
                summary["samples_per_s"] = rate
            windows = max(0, taken - 1) if every > self.persist_steps else 0
            summary["optimizations"]["checkpoint"] = {
                "every": every,
                "checkpoints": taken + 1,
                "persist_s_mean": max(0.05, self.persist_steps * step_s),
                "stall_s_mean": 0.002,
                "cost_s_mean": self.cost_s * noise if windows else None,
                "cost_s_se": self.cost_s * 0.2 if windows > 1 else None,
                "cost_windows": windows,
                "clean_step_s": step_s,
            }
        with self._lock:
            self.ran.append((n, data, summary["samples_per_s"]))
        return summary
