"""CheckFreq's checkpoint-frequency policy (Mohan et al., FAST '21), measured, not assumed."""

from __future__ import annotations

import math
import statistics


class AutoInterval:
    """Chooses the checkpoint interval k (in steps) so that the overhead stays under ``p``.

    It first times ``profile_steps`` steps with no checkpoint (the base step
    time T, then frozen). Each checkpoint's cost is everything it added to the
    steps up to the next one: the window's time minus ``steps * T``. That
    counts the stall and every slow-down beside the snapshot and the persist
    (on a small machine the slow-down dominates). Then

        k = max(ceil(cost / (p * T)), ceil(persist / T) + 1)

    so that cost / (k T) is at most p and a persist finishes before the next
    snapshot needs its buffers. k is re-measured after every checkpoint and
    raised when a window shows more overhead than p (a slower disk, a busier
    machine); it is never lowered.
    """

    def __init__(self, max_overhead: float, profile_steps: int = 5) -> None:
        self.max_overhead = max_overhead
        self.profile_steps = profile_steps
        self.interval: int | None = None
        self._profile: list[float] = []
        self.history: list[dict[str, float]] = []

    @property
    def base_step_s(self) -> float | None:
        return statistics.median(self._profile) if self.ready else None

    @property
    def ready(self) -> bool:
        return len(self._profile) >= self.profile_steps

    def record_profile_step(self, seconds: float) -> None:
        """A step before any checkpoint: sets the base step time."""
        if not self.ready:
            self._profile.append(seconds)

    def after_window(self, window_s: float, steps: int, persist_s: float) -> int:
        """Account for one checkpoint: ``steps`` steps took ``window_s`` from its start."""
        base = self.base_step_s or 1e-3
        cost = max(0.0, window_s - steps * base)
        needed = max(
            math.ceil(cost / (self.max_overhead * base)), math.ceil(persist_s / base) + 1, 1
        )
        if self.interval is None or needed > self.interval:
            self.interval = needed
        self.history.append(
            {
                "window_s": window_s,
                "steps": float(steps),
                "cost_s": cost,
                "overhead": cost / (steps * base) if steps else 0.0,
                "persist_s": persist_s,
                "base_step_s": base,
                "interval": float(self.interval),
            }
        )
        return self.interval
