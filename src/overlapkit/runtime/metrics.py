"""Per-step phase times, step records, and the run summary across ranks.

The `PhaseClock` always has exactly one current phase; switching phases
closes the time since the last switch into the phase that was current. The
phases of a step therefore add up to the step's time by construction, and
time nobody claimed lands in ``other`` instead of disappearing. On a GPU the
switches are CUDA events, read a few steps later (see `timing`).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .timing import Mark, Marks, Seconds, resolve

PHASES = (
    "data_wait",
    "forward",
    "backward",
    "comm_exposed",
    "optimizer",
    "ckpt_stall",
    "bubble",
    "other",
)
USEFUL_PHASES = ("forward", "backward", "optimizer")
PAUSED = "paused"  # time inside a step that belongs to none (left out of the step)


class StepTiming:
    """One closed step's phase times, readable once its marks are (`ready`)."""

    def __init__(
        self,
        marks: Marks,
        spans: list[tuple[str, Mark, Mark]],
        moved: list[tuple[str, str, Seconds]],
    ) -> None:
        self._marks, self._spans, self._moved = marks, spans, moved
        self._result: tuple[float, dict[str, float]] | None = None

    def ready(self) -> bool:
        return self._result is not None or self._marks.ready(self._spans[-1][2])

    def result(self) -> tuple[float, dict[str, float]]:
        """The step's time and the time of each phase (they add up to it)."""
        if self._result is None:
            totals = dict.fromkeys(PHASES, 0.0)
            for phase, begin, end in self._spans:
                if phase != PAUSED:  # the script's own pause (Session.paused): no step's
                    # (a loop may add a phase of its own: TensorFlow's compiled step)
                    totals[phase] = totals.get(phase, 0.0) + Marks.seconds(begin, end)
            for source, target, seconds in self._moved:
                seconds = min(max(resolve(seconds), 0.0), totals[source])
                totals[source] -= seconds
                totals[target] += seconds
            # Each mark is released by the step it begins a span in, so steps are read
            # in order; the last one is the next step's first (or dropped by `pause`).
            self._marks.release(*(begin for _, begin, _ in self._spans))
            self._result = sum(totals.values()), totals
        return self._result


class PhaseClock:
    """Attributes the time of each step to phases.

    Each phase switch takes a mark (see `timing.Marks`): the host's clock on a
    CPU, a CUDA event on the device's timeline on a GPU, where host-side times
    of asynchronous kernels would put the work in whichever phase happens to
    wait for the device. A closed step's times are read later (`close_step`
    returns them pending), so measuring never makes the host wait.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.marks = Marks(device)
        self.current = "other"
        self._spans: list[tuple[str, Mark, Mark]] = []
        self._moved: list[tuple[str, str, Seconds]] = []
        self._since: Mark | None = None
        self._last_end: Mark | None = None

    def start_step(self) -> None:
        """Open a step. It starts where the previous one ended (the time in between
        is this step's ``other``), unless `pause` was called since."""
        self._spans, self._moved = [], []
        self.current = "other"
        self._since = self._last_end if self._last_end is not None else self.marks.mark()

    def pause(self) -> None:
        """Leave the time until the next step out of every step (e.g. evaluation)."""
        self._last_end = None  # not to the pool: the last step may not have been read yet

    def switch(self, phase: str) -> str:
        """Make ``phase`` current; return the phase that was current."""
        now = self.marks.mark()
        self._spans.append((self.current, self._since, now))
        self._since = now
        previous, self.current = self.current, phase
        return previous

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the time inside the block as ``name``, e.g. ``ckpt_stall``."""
        previous = self.switch(name)
        try:
            yield
        finally:
            self.switch(previous)

    def reattribute(self, source: str, target: str, seconds: Seconds) -> None:
        """Move time measured by other means (e.g. exposed all-reduce inside
        ``backward``) from one phase to another when the step's times are read.
        ``seconds`` may be a callable, called then (when the device is done)."""
        self._moved.append((source, target, seconds))

    def close_step(self) -> StepTiming:
        """Close the step; its times are read from the result when ready."""
        self.switch("other")
        self._last_end = self._since
        return StepTiming(self.marks, self._spans, self._moved)

    def end_step(self) -> tuple[float, dict[str, float]]:
        """Close the step and read its time and the time of each phase now."""
        return self.close_step().result()


def step_record(
    *,
    step: int,
    rank: int,
    loss: float | None,
    samples: int,
    step_time_s: float,
    phases_s: dict[str, float],
    warmup: bool,
) -> dict[str, Any]:
    """One line of ``steps.jsonl``."""
    return {
        "step": step,
        "rank": rank,
        "loss": loss,
        "step_time_s": step_time_s,
        "samples": samples,
        "samples_per_s": samples / step_time_s if step_time_s > 0 else 0.0,
        "warmup": warmup,
        "phases_s": phases_s,
    }


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = q * (len(ordered) - 1)
    low = int(index)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (index - low)


SE_BATCHES = (4, 8)  # the fewest and most batches of steps a run's standard error takes


def mean_se_rel(step_times: list[float]) -> float | None:
    """The relative standard error of a run's mean step time (so of its throughput),
    from the means of contiguous batches of its steps, 2 steps at least, 4 to 8
    batches: neighbouring steps are not independent (a checkpoint or a slow spell
    slows several), so the spread of batch means holds what the spread of single
    steps would understate. None below 8 steps."""
    fewest, most = SE_BATCHES
    batches = min(most, len(step_times) // 2)
    if batches < fewest:
        return None
    size = len(step_times) // batches
    means = [statistics.fmean(step_times[i * size : (i + 1) * size]) for i in range(batches)]
    mean = statistics.fmean(means)
    return statistics.stdev(means) / batches**0.5 / mean if mean > 0 else None


def _mean_or_none(values: list[float | None]) -> float | None:
    return None if None in values else statistics.fmean(values)


def _sum_or_none(values: list[float | None]) -> float | None:
    return None if None in values else sum(values)


POP_KEYS = ("load_balance", "communication_efficiency", "parallel_efficiency")


def pop_metrics(useful_s: list[float | None], runtime_s: float) -> dict[str, float | None]:
    """POP efficiency metrics from each rank's useful compute time.

    load balance = mean / max useful compute; communication efficiency =
    max useful compute / runtime; parallel efficiency = their product. A rank
    whose useful compute was not measured (None) makes them all None.
    """
    if any(u is None for u in useful_s):
        return dict.fromkeys(POP_KEYS)
    if not useful_s or runtime_s <= 0 or max(useful_s) <= 0:
        return {"load_balance": 0.0, "communication_efficiency": 0.0, "parallel_efficiency": 0.0}
    load_balance = statistics.fmean(useful_s) / max(useful_s)
    communication = max(useful_s) / runtime_s
    return {
        "load_balance": load_balance,
        "communication_efficiency": communication,
        "parallel_efficiency": load_balance * communication,
    }


def summarize(records: list[dict[str, Any]], world_size: int) -> dict[str, Any]:
    """The measured (non-warm-up) part of a run, across all ranks."""
    measured = [r for r in records if not r["warmup"]]
    ranks = sorted({r["rank"] for r in records})
    by_rank = {rank: [r for r in measured if r["rank"] == rank] for rank in ranks}
    by_step: dict[int, list[dict[str, Any]]] = {}
    for record in measured:
        by_step.setdefault(record["step"], []).append(record)
    # A synchronous step takes as long as its slowest rank.
    step_times = [max(r["step_time_s"] for r in group) for _, group in sorted(by_step.items())]
    rank_runtime = {rank: sum(r["step_time_s"] for r in rs) for rank, rs in by_rank.items()}
    runtime = max(rank_runtime.values(), default=0.0)
    samples = sum(r["samples"] for r in measured)
    # A phase some step did not measure (None: TensorFlow's unsplit compiled step) is None.
    # No measured step (all warm-up: a run resumed at its last step): nothing measured.
    phases = {
        phase: _mean_or_none([r["phases_s"][phase] for r in measured]) if measured else None
        for phase in PHASES
    }
    mean_step = statistics.fmean(r["step_time_s"] for r in measured) if measured else 0.0
    useful = [
        _sum_or_none([r["phases_s"][p] for r in rs for p in USEFUL_PHASES])
        for rs in by_rank.values()
    ]
    last_step = by_step.get(max(by_step, default=-1), [])
    losses = [r["loss"] for r in last_step if r["loss"] is not None]
    per_rank = [
        {
            "rank": rank,
            "samples_per_s": sum(r["samples"] for r in rs) / rank_runtime[rank]
            if rank_runtime[rank] > 0
            else None,
            "runtime_s": rank_runtime[rank],
            "useful_compute_s": u,
        }
        for (rank, rs), u in zip(by_rank.items(), useful, strict=True)
    ]
    return {
        "world_size": world_size,
        "steps": len(step_times),
        "samples": samples,
        "runtime_s": runtime,
        "samples_per_s": samples / runtime if runtime > 0 else None,
        "step_time_s": {
            "mean": statistics.fmean(step_times) if step_times else None,
            "p50": _percentile(step_times, 0.5) if step_times else None,
            "p90": _percentile(step_times, 0.9) if step_times else None,
            "se_rel": mean_se_rel(step_times),
        },
        "phases_s": phases,
        "phase_shares": {
            p: None if t is None else t / mean_step if mean_step else 0.0 for p, t in phases.items()
        },
        "pop": pop_metrics(useful, runtime) if measured else dict.fromkeys(POP_KEYS),
        "final_loss": statistics.fmean(losses) if losses else None,
        "per_rank": per_rank,
    }
