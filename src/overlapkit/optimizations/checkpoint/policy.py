"""CheckFreq's checkpoint-frequency policy (Mohan et al., FAST '21), measured, not assumed."""

from __future__ import annotations

import math
import statistics


class AutoInterval:
    """Chooses the checkpoint interval k (in steps) so that the overhead stays under ``p``.

    It first times ``profile_steps`` steps with no checkpoint activity (the
    base step time T), then takes a checkpoint to measure its cost: the stall
    it caused plus the slow-down of the steps that ran beside it. Then

        k = max(ceil(cost / (p * T)), ceil(persist / T))

    so that the overhead cost / (k T) is at most p and a persist finishes
    before the next snapshot needs its buffers. It keeps measuring each
    checkpoint and raises k when the measured overhead exceeds p (a slower
    disk, a busier machine); it never lowers k.
    """

    def __init__(self, max_overhead: float, profile_steps: int = 5) -> None:
        self.max_overhead = max_overhead
        self.profile_steps = profile_steps
        self.interval: int | None = None
        self._clean: list[float] = []
        self.history: list[dict[str, float]] = []

    @property
    def base_step_s(self) -> float | None:
        return statistics.median(self._clean) if self._clean else None

    def record_clean_step(self, seconds: float) -> None:
        """A step during which nothing of the checkpoint was in flight."""
        self._clean.append(seconds)
        del self._clean[:-50]  # a recent window: the machine's speed drifts

    @property
    def ready(self) -> bool:
        return len(self._clean) >= self.profile_steps

    def after_checkpoint(self, stall_s: float, slowdown_s: float, persist_s: float) -> int:
        base = self.base_step_s or 1e-3
        cost = stall_s + slowdown_s
        needed = max(math.ceil(cost / (self.max_overhead * base)), math.ceil(persist_s / base), 1)
        previous = self.interval
        if previous is None or needed > previous:
            self.interval = needed
        self.history.append(
            {
                "stall_s": stall_s,
                "slowdown_s": slowdown_s,
                "persist_s": persist_s,
                "base_step_s": base,
                "interval": float(self.interval),
            }
        )
        return self.interval
