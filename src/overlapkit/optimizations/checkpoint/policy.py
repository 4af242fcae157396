"""CheckFreq's checkpoint-frequency policy (Mohan et al., FAST '21), measured, not assumed."""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any


class AutoInterval:
    """Decides when to checkpoint so that the overhead stays under ``max_overhead`` (p).

    It is fed every step's time. Steps outside any checkpoint's window set the
    base step time T (the median of the last ``clean_steps``). The first
    checkpoint comes after ``profile_steps`` such steps and is measured alone:
    its window closes when its persist is done. Every later window runs from
    one checkpoint to the next. A window's *cost* is everything the checkpoint
    added: the window's time minus its steps at the base time (the window's
    own median once it has 8 steps, so that a machine that slows down as a
    whole is not blamed on checkpoints). On a small machine the slow-down
    beside the snapshot and the persist is most of it, the stall a small part.

    From the recent cost c (the mean of the last three windows; the first
    window only until a second one is measured), CheckFreq's interval

        k = max(ceil(c / (p T)), ceil(persist / T) + 1)

    keeps the steady overhead at p and lets a persist finish before the next
    snapshot needs its buffers. On top, a budget: the next checkpoint may
    start only once the time trained so far pays for every cost measured so
    far, the one in flight and the next one at p. So the first checkpoint's
    one-time costs (allocating the host buffers, a cold page cache) and any
    window that cost more than predicted (a slower disk, a busier machine) are
    paid back by waiting longer, and the overhead of the whole run stays under
    p, not only that of the steady state.
    """

    def __init__(self, max_overhead: float, profile_steps: int = 5, clean_steps: int = 50):
        self.max_overhead = max_overhead
        self.profile_steps = profile_steps
        self.interval: int | None = None  # CheckFreq's k, once the first checkpoint is measured
        self.history: list[dict[str, float]] = []
        self._clean: deque[float] = deque(maxlen=clean_steps)
        self._window: list[float] | None = None  # step times since a checkpoint started
        self._started = 0
        self._elapsed = 0.0
        self._cost = 0.0
        self._costs: deque[float] = deque(maxlen=3)
        self._first_cost: float | None = None
        self._persist_s = 0.0
        self._due_at = 0.0  # elapsed seconds before which no checkpoint starts

    @property
    def base_step_s(self) -> float | None:
        return statistics.median(self._clean) if self._clean else None

    @property
    def overhead(self) -> float:
        """Measured cost of all closed windows over the time trained so far."""
        return self._cost / self._elapsed if self._elapsed else 0.0

    def record_step(self, seconds: float) -> None:
        self._elapsed += seconds
        (self._window if self._window is not None else self._clean).append(seconds)

    def due(self, steps_since_last: int) -> bool:
        if self._started == 0:
            return len(self._clean) >= self.profile_steps
        if self.interval is None:
            return False  # the first checkpoint is still being measured
        return steps_since_last >= self.interval and self._elapsed >= self._due_at

    def checkpoint_started(self) -> None:
        if self._window is not None:
            self._close_window(in_flight=1)
        self._window = []
        self._started += 1

    def persist_finished(self, persist_s: float) -> None:
        self._persist_s = persist_s
        if self.interval is None and self._window is not None:
            self._close_window(in_flight=0)  # the first checkpoint, measured alone

    def finish(self) -> None:
        """The run ended: the open window's cost counts too (its steps already do)."""
        if self._window is not None:
            self._close_window(in_flight=0)

    def _close_window(self, in_flight: int) -> None:
        steps, self._window = self._window or [], None
        if not steps:
            return
        base = statistics.median(steps) if len(steps) >= 8 else self.base_step_s
        base = base or sum(steps) / len(steps)
        cost = max(0.0, sum(steps) - len(steps) * base)
        self._cost += cost
        if self.interval is not None and self._first_cost is not None:
            self._costs.clear()  # the first one paid the one-time costs: budget them only
            self._first_cost = None
        self._costs.append(cost)
        if self.interval is None:
            self._first_cost = cost
        p = self.max_overhead
        recent = sum(self._costs) / len(self._costs)
        self.interval = max(
            math.ceil(recent / (p * base)), math.ceil(self._persist_s / base) + 1, 1
        )
        self._due_at = (self._cost + recent * (in_flight + 1)) / p
        self.history.append(
            {
                "window_s": sum(steps),
                "steps": float(len(steps)),
                "cost_s": cost,
                "overhead": cost / (len(steps) * base),
                "persist_s": self._persist_s,
                "base_step_s": base,
                "interval": float(self.interval),
                "run_overhead": self.overhead,
            }
        )


class CheckpointCost:
    """What a checkpoint costs the steps, measured in the run itself (at any interval,
    auto or fixed): what the goodput model's interval (Young/Daly) is computed from.

    A step is *busy* when a checkpoint starts at it (its snapshot) or a persist is
    still in flight as it starts; otherwise it is *clean*. A window is a checkpoint's
    run of busy steps (two checkpoints whose busy steps touch share one). Its cost is
    the time its steps took beyond as many clean steps (the clean steps' mean): the
    stall plus the slow-down of the steps that shared the cores, the memory bus and
    the disk with the copy and the persist. Means, not medians: step times are skewed,
    and a median would find a cost where there is none. Only measured steps count
    (not the warm-up), and only windows that closed before the run ended. Kept as
    sums, a few numbers a window: a long run holds no list of its steps.
    """

    def __init__(self) -> None:
        self._clean_s, self._clean_n = 0.0, 0
        self._windows: list[tuple[float, int, int]] = []  # closed: (seconds, steps, checkpoints)
        self._open: tuple[float, int, int] | None = None

    def record(self, seconds: float, starts: bool, busy: bool) -> None:
        """One measured step, in order: its seconds, whether a checkpoint started at it,
        whether a persist was in flight as it started."""
        if not (busy or starts):
            self._clean_s, self._clean_n = self._clean_s + seconds, self._clean_n + 1
            if self._open is not None:
                self._windows.append(self._open)  # closed by a clean step
            self._open = None
        elif starts or self._open is not None:  # (busy steps before the first start: none)
            total, steps, count = self._open or (0.0, 0, 0)
            self._open = (total + seconds, steps + 1, count + starts)

    def estimate(self) -> dict[str, Any]:
        """cost_s_mean (seconds a checkpoint adds to the steps), cost_s_se (its standard
        error, from the windows' spread; None from one window), the windows measured and
        the clean steps' mean time; the cost is None when no window closed or no step
        ran clean (a persist outlasting the interval), with the reason."""
        base = self._clean_s / self._clean_n if self._clean_n else None
        out: dict[str, Any] = {
            "cost_s_mean": None,
            "cost_s_se": None,
            "cost_windows": len(self._windows),
            "clean_step_s": base,
        }
        if base is None or not self._windows:
            out["cost_note"] = (
                "no measured step ran without a checkpoint in flight (a persist outlasts "
                "the interval)"
                if base is None
                else "no checkpoint's steps fell (whole) inside the measured steps"
            )
            return out
        costs = [(total - steps * base) / count for total, steps, count in self._windows]
        out["cost_s_mean"] = statistics.fmean(costs)
        if len(costs) > 1:
            out["cost_s_se"] = statistics.stdev(costs) / math.sqrt(len(costs))
        return out
