"""How far a study is: its phases' trial counts announced before the first trial
(the later phases' as upper bounds, since what they measure depends on what the
search finds), and a progress bar whose time left comes from the trials that
finished, divided among the trials that run at once."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..runtime.progress import ProgressBar
from .config import TuneConfig
from .space import SearchSpace

PHASES = ("probe: a checkpoint's cost", "references", "search", "confirm round 1", "analysis")


@dataclass
class StudyPlan:
    """Trials per phase: exact once the phase starts, an upper bound before."""

    counts: dict[str, int]
    exact: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, space: SearchSpace, tune: TuneConfig, probes: bool = False) -> StudyPlan:
        """``probes``: the checkpoint's interval comes from the model, whose cost
        probes run first (and once more with the pick)."""
        optimizations = space.optimizations
        references = 2 + sum(  # baseline, each alone at each level it is on, all on
            len([v for v in space.level(n).values() if v != space.level(n).off_value])
            for n in optimizations
        )
        rows = 2 + len(optimizations)  # the comparison rows that race with the finalists
        racing = tune.finalists + (rows if tune.references else 0)
        sweeps = sum(
            len(space.level(n).values()) + (space.level(n).off_value is None) for n in optimizations
        )
        pairs = math.comb(len(optimizations), 2)
        policies = sum(len(d.choices) - 1 for d in space.dimensions if d.name == "scheduler.policy")
        search = cls.search_trials(space, tune)
        controls = (search - 1) // tune.control_every if tune.control_every else 0
        counts = {
            PHASES[0]: 2 * tune.probes if probes else 0,
            "references": references if tune.references else 0,
            "search": search + controls,
            PHASES[3]: racing * tune.max_repeats if tune.repeats > 1 else 0,
            "analysis": 1 + sweeps + pairs + policies if tune.references else 0,
        }
        return cls(counts)

    @staticmethod
    def search_trials(space: SearchSpace, tune: TuneConfig) -> int:
        """The search phase's trials: ``tune.trials``, or fewer where a grid ends first."""
        return min(tune.trials, space.grid_size()) if tune.sampler == "grid" else tune.trials

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def started(self, phase: str, trials: int) -> None:
        """``phase`` starts with ``trials`` to run: its count is now known."""
        self.counts[phase] = trials
        self.exact.add(phase)

    def describe(self) -> str:
        """E.g. "up to 35 trials: 9 references, 4 search, then up to 12 confirm, ..."."""
        names = {PHASES[0]: "probes", PHASES[3]: "confirm"}
        first = [p for p in PHASES[:3] if self.counts[p]]
        later = [p for p in PHASES[3:] if self.counts[p]]
        said = lambda p: f"{self.counts[p]} {names.get(p, p)}"  # noqa: E731
        text = f"up to {self.total} trials: " + ", ".join(map(said, first))
        if later:
            text += ", then up to " + ", ".join(map(said, later))
        return text + " (each later phase depends on what the search finds)"


def time_left(durations: list[float], remaining: int, at_once: int) -> float | None:
    """Seconds left: the median finished trial's time for each remaining trial, with
    ``at_once`` trials running side by side (None before any trial finished)."""
    if not durations:
        return None
    return statistics.median(durations) * math.ceil(remaining / max(1, at_once))


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "time left: after the first trial"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"about {hours}:{minutes:02d}:{secs:02d} left (at most)"


class StudyProgress:
    """The bar under the trial lines (on a terminal; elsewhere the plan line alone)."""

    def __init__(self, plan: StudyPlan, done: int, at_once: int, console: Console) -> None:
        self.plan, self.done, self.at_once = plan, done, at_once
        self.durations: list[float] = []
        self._last = time.monotonic()
        self._progress = None
        if console.is_terminal and ProgressBar.wanted():
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[left]}"),
                console=console,
                refresh_per_second=2,
            )
            self._task = self._progress.add_task(
                "study", total=max(plan.total, done), completed=done, left=_clock(None)
            )
            self._progress.start()

    def phase(self, name: str, trials: int, counted: bool = True) -> None:
        """``name`` starts with ``trials`` to run; ``counted``: it is a phase of the plan,
        whose count is now exact (a later round of a phase keeps the phase's bound)."""
        if counted and name in self.plan.counts and name not in (PHASES[0], PHASES[3]):
            self.plan.started(name, trials)  # (the probes and the race: bounds to the end)
        self._update(description=name)

    def finished(self, duration_s: float | None) -> None:
        """One trial ended (``duration_s``: its own time, when the storage has it)."""
        now = time.monotonic()
        self.durations.append(duration_s if duration_s is not None else now - self._last)
        self._last = now
        self.done += 1
        self._update()

    def seconds_left(self) -> float | None:
        return time_left(self.durations, max(0, self.total - self.done), self.at_once)

    @property
    def total(self) -> int:
        return max(self.plan.total, self.done)

    def _update(self, **fields: str) -> None:
        if self._progress is not None:
            self._progress.update(
                self._task,
                completed=self.done,
                total=self.total,
                left=_clock(self.seconds_left()),
                **fields,
            )

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
