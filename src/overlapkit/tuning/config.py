"""The ``tune`` section of a scenario."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ..config import Config


class TuneConfig(Config):
    trials: int = Field(40, ge=1)  # the sampler's trials, besides the reference ones
    objective: Literal["throughput", "goodput", "both"] = "throughput"
    sampler: Literal["tpe", "random", "grid"] = "tpe"
    # What is searched: optimization -> knobs. Absent: every optimization of the
    # scenario by its intensity. A knob given by name takes its declared range or
    # choices; {knob: [a, b, c]} searches those values; {knob: {low, high, log}} a range.
    search: dict[str, list[str] | dict[str, Any] | None] | None = None
    intensity_step: float = Field(0.25, gt=0, le=1)  # intensities searched: 0, step, ..., 1
    policy: bool = True  # also search the scheduler's policy (free | priority)
    references: bool = True  # measure baseline, each alone, all on, contention curves
    steps: int = Field(12, ge=1)  # measured steps per trial
    warmup_steps: int = Field(3, ge=0)
    # Noise: the `finalists` best settings of the search and the comparison rows
    # are measured until each has `repeats` results; the best is the best median.
    finalists: int = Field(3, ge=0)
    repeats: int = Field(3, ge=1)
    prune: bool = True  # stop a trial early when it is clearly worse (objective: throughput)
    trial_timeout_s: float = Field(600, gt=0)
    # Goodput: throughput discounted by the work a failure costs at this MTBF.
    mtbf_hours: float = Field(24.0, gt=0)
    restart_s: float = Field(60.0, ge=0)  # time to notice a failure, restart and restore
    job_hours: float = Field(24.0, gt=0)  # the training job's length (rework without checkpoints)
    storage: str | None = None  # an Optuna storage URL; None = SQLite in the tune folder
    study: str | None = None  # default: the scenario's name

    @property
    def trial_steps(self) -> int:
        """The steps a trial runs: its warm-up, then the measured ones."""
        return self.warmup_steps + self.steps
