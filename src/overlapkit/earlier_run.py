"""What a new run may do with a folder an earlier run left there, decided before any
rank starts: resume it, or refuse with one line and leave it as it is (checkpoints
of another model or optimizer, a run already finished, results a new run would
write over)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import yaml

from .optimizations.checkpoint.setup import setup_changes, setup_record
from .optimizations.checkpoint.store import checkpoint_folder, fresh_flags, holds
from .runtime import KnobError
from .scenarios import Scenario
from .scenarios.config import build_optimizations


class EarlierRunError(ValueError):
    """The run folder holds an earlier run that this one must not resume or overwrite."""


class ScheduleWarning(UserWarning):
    """A resume with another step count changes a cosine or linear schedule's rest."""


def check_earlier_run(folder: Path, scenario: Scenario, fresh: bool) -> None:
    """Raise `EarlierRunError` when a run of ``scenario`` in ``folder`` would resume
    checkpoints of another setup, resume a run that already finished, or (without
    ``fresh``) write over the results of a finished run it does not resume. The
    checkpoints' setup is the one recorded beside them (see `saved_setup`), wherever
    their folder is; for checkpoints without one, the run folder's scenario.yaml."""
    optimizations = scenario.build_optimizations()
    resumes_at = max(
        (s for o in optimizations if (s := o.resumes_at(folder)) is not None), default=None
    )
    # checkpoint resume: false asks for a fresh start every time, as --fresh does once.
    fresh = fresh or any(o.name == "checkpoint" and not o.settings["resume"] for o in optimizations)
    if resumes_at is not None:
        recorded = next((s for o in optimizations if (s := o.saved_setup(folder))), None)
        if recorded is None and (earlier := scenario_in(folder)) is not None:
            recorded = _setup_of(earlier)  # checkpoints of a version that recorded none
        checkpoint = next((o for o in optimizations if o.name == "checkpoint"), None)
        configured = checkpoint.settings["dir"] if checkpoint is not None else "."
        # An absolute checkpoint.dir may be shared by several run folders: it is named.
        root = checkpoint_folder(folder, configured)
        inside = holds(folder, root)
        where, again = (folder if inside else root), fresh_flags(folder, configured)
        if recorded is None:  # an older version's checkpoints outside any run folder
            return
        changes = setup_changes(recorded, saved_setup(scenario))
        if changes:
            raise EarlierRunError(
                f"{where} holds checkpoints of another setup ({'; '.join(changes)}): "
                "resuming would load them into a different model, optimizer or data "
                f"order. Run that setup again, start over there with {again} (its "
                "checkpoints are kept aside), or "
                + ("name another folder with --out" if inside else "set another checkpoint.dir")
            )
        total = scenario.train.total_steps
        if resumes_at >= total:
            raise EarlierRunError(
                f"nothing to resume: {where} already trained {resumes_at} steps (its "
                f"newest checkpoint), and this scenario trains {total} in all "
                f"(train.steps {scenario.train.steps} + warmup_steps "
                f"{scenario.train.warmup_steps}): raise train.steps to train on, or "
                f"start over there with {again}"
            )
        _warn_if_schedule_stretches(scenario_in(folder), scenario, resumes_at)
    elif (folder / "summary.json").exists() and not fresh:
        raise EarlierRunError(
            f"{folder} holds the results of a finished run (summary.json) and nothing "
            "this run would resume: a run there would write over them. Leave --out out "
            f"for a new folder, or start over there with --out {folder} --fresh"
        )


def _warn_if_schedule_stretches(
    earlier: dict[str, Any] | None, scenario: Scenario, resumes_at: int
) -> None:
    """A cosine or linear schedule decays over the run's total steps: resumed with more
    (or fewer), its remaining steps follow the new length, not the earlier run's."""
    schedule = scenario.train.lr_schedule.name
    before = (earlier or {}).get("train") or {}
    try:
        total_before = int(before.get("steps", 0)) + int(before.get("warmup_steps", 0))
    except (TypeError, ValueError):
        return
    total = scenario.train.total_steps
    if schedule in ("cosine", "linear") and total_before and total_before != total:
        warnings.warn(
            f"resuming at step {resumes_at} with {total} steps in all where the earlier run "
            f"had {total_before}: the {schedule} learning-rate schedule decays over {total} "
            "from here on, so the rate jumps at the resumed step and differs from both a "
            f"run of {total_before} and one of {total} steps from the start",
            ScheduleWarning,
            stacklevel=2,
        )


def saved_setup(scenario: Scenario) -> dict[str, Any]:
    """What the checkpoints of a run of ``scenario`` depend on (see `setup_record`), as
    recorded in their manifest, so that a run resuming them is checked against it
    wherever they are."""
    return _setup_of(scenario.model_dump(mode="json"), scenario.build_optimizations())


def _setup_of(data: dict[str, Any], optimizations: list[Any] | None = None) -> dict[str, Any]:
    if optimizations is None:
        try:
            optimizations = build_optimizations(data.get("optimizations") or {})
        except (KnobError, TypeError, AttributeError):
            optimizations = None  # a section this version cannot read: the setup decides
    layouts = (
        {o.name: layout for o in optimizations if (layout := o.saved_layout())}
        if optimizations is not None
        else None
    )
    return setup_record(data, layouts)


def scenario_in(folder: Path) -> dict[str, Any] | None:
    """The scenario an earlier run wrote in ``folder`` (None: no earlier run)."""
    try:
        data = yaml.safe_load((folder / "scenario.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None
