"""The ``tune`` section of a scenario."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

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
    # The confirm phase's race: the `finalists` best settings of the search and the
    # comparison rows, measured side by side in rounds: `repeats` rounds before any is
    # judged (1: no race), then more until the best is beyond the noise of the rest, at
    # most `max_repeats`. The pick: the simplest setting within noise of the best.
    finalists: int = Field(3, ge=0)
    repeats: int = Field(2, ge=1)
    max_repeats: int = Field(5, ge=1)
    # The search measures the control (the baseline) again every `control_every` of its
    # trials, so the report can show the machine's drift and correct for it (0: never).
    control_every: int = Field(5, ge=0)
    # A trial measures `steps` steps, more (up to `max_steps`, default 3 x steps) for a
    # setting whose steps vary more: until its mean's standard error is about `window_se`.
    window_se: float = Field(0.015, gt=0, lt=1)
    max_steps: int | None = Field(None, ge=1)
    # With goodput in the objective: the checkpoint interval from the Young/Daly model
    # and a measured cost (model), or searched like any other knob (search); at most
    # `probes` trials measure the cost.
    checkpoint_interval: Literal["model", "search"] = "model"
    probes: int = Field(3, ge=1)
    prune: bool = True  # stop a trial early when it is clearly worse (objective: throughput)
    trial_timeout_s: float = Field(600, gt=0)
    # Goodput: throughput discounted by the work a failure costs at this MTBF.
    mtbf_hours: float = Field(24.0, gt=0)
    restart_s: float = Field(60.0, ge=0)  # time to notice a failure, restart and restore
    job_hours: float = Field(24.0, gt=0)  # the training job's length (rework without checkpoints)
    seed: int | None = None  # the sampler's seed (None: another each run)
    storage: str | None = None  # an Optuna storage URL; None = SQLite in the tune folder
    study: str | None = None  # default: the scenario's name

    @model_validator(mode="after")
    def _rounds_and_windows(self) -> TuneConfig:
        if self.max_repeats < self.repeats:
            raise ValueError(
                f"max_repeats ({self.max_repeats}) is below repeats ({self.repeats}): the race "
                "runs repeats rounds before it judges, and stops at max_repeats"
            )
        if self.max_steps is not None and self.max_steps < self.steps:
            raise ValueError(f"max_steps ({self.max_steps}) is below steps ({self.steps})")
        return self

    @property
    def longest(self) -> int:
        """The most measured steps a trial may run (`max_steps`, default 3 x `steps`)."""
        return self.max_steps if self.max_steps is not None else 3 * self.steps

    @property
    def trial_steps(self) -> int:
        """The steps a trial runs: its warm-up, then the measured ones."""
        return self.warmup_steps + self.steps
