"""What a new run may do with a folder an earlier run left there, decided before any
rank starts: resume it, or refuse with one line and leave it as it is (checkpoints
of another model or optimizer, a run already finished, results a new run would
write over)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .runtime import KnobError
from .scenarios import Scenario
from .scenarios.config import build_optimizations
from .scenarios.diff import first_difference, value_at

# What a checkpoint's state depends on: a change in any of these makes a resume load
# a different model, optimizer or data position (the step count and the learning rate
# may change: they train on).
SAVED_WITH = (
    "framework",
    "model",
    "data.name",
    "data.shape",
    "data.num_classes",
    "data.num_samples",
    "train.optimizer.name",
    "train.batch_size",
    "train.accumulate",
    "train.seed",
)


class EarlierRunError(ValueError):
    """The run folder holds an earlier run that this one must not resume or overwrite."""


def check_earlier_run(folder: Path, scenario: Scenario, fresh: bool) -> None:
    """Raise `EarlierRunError` when a run of ``scenario`` in ``folder`` would resume
    checkpoints of another setup, resume a run that already finished, or (without
    ``fresh``) write over the results of a finished run it does not resume."""
    earlier = scenario_in(folder)
    if earlier is None:
        return
    optimizations = scenario.build_optimizations()
    resumes_at = max(
        (s for o in optimizations if (s := o.resumes_at(folder)) is not None), default=None
    )
    # checkpoint resume: false asks for a fresh start every time, as --fresh does once.
    fresh = fresh or any(o.name == "checkpoint" and not o.settings["resume"] for o in optimizations)
    if resumes_at is not None:
        changes = setup_changes(earlier, scenario.model_dump(mode="json"))
        changes += layout_changes(earlier, optimizations)
        if changes:
            raise EarlierRunError(
                f"{folder} holds checkpoints of another setup ({'; '.join(changes)}): "
                "resuming would load them into a different model, optimizer or data "
                f"order. Run that setup again, start over there with --out {folder} --fresh "
                "(its checkpoints are kept aside), or name another folder with --out"
            )
        total = scenario.train.total_steps
        if resumes_at >= total:
            raise EarlierRunError(
                f"nothing to resume: {folder} already trained {resumes_at} steps (its "
                f"newest checkpoint), and this scenario trains {total} in all "
                f"(train.steps {scenario.train.steps} + warmup_steps "
                f"{scenario.train.warmup_steps}): raise train.steps to train on, or "
                f"start over there with --out {folder} --fresh"
            )
    elif (folder / "summary.json").exists() and not fresh:
        raise EarlierRunError(
            f"{folder} holds the results of a finished run (summary.json) and nothing "
            "this run would resume: a run there would write over them. Leave --out out "
            f"for a new folder, or start over there with --out {folder} --fresh"
        )


def setup_changes(earlier: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between two scenarios (as plain data) in what checkpoints depend
    on, as ``path before -> now`` (a whole section by its first differing key)."""
    found = (
        first_difference(value_at(earlier, path), value_at(now, path), path) for path in SAVED_WITH
    )
    return [change for change in found if change is not None]


def layout_changes(earlier: dict[str, Any], optimizations: list[Any]) -> list[str]:
    """How the earlier run's optimizations laid out its checkpoints differently from
    ``optimizations`` (see `Optimization.saved_layout`), as ``optimizations.NAME before
    -> now`` ("off" where one of the two runs lacks it)."""
    try:
        before = _layouts(build_optimizations(earlier.get("optimizations") or {}))
    except (KnobError, TypeError, AttributeError):
        return []  # a section this version cannot read: the setup above still decides
    now = _layouts(optimizations)
    changes = []
    for name in sorted(before.keys() | now.keys()):
        was, is_now = before.get(name), now.get(name)
        if was is None or is_now is None:  # turned on or off
            changes.append(f"optimizations.{name} {_said(was)} -> {_said(is_now)}")
        elif change := first_difference(was, is_now, f"optimizations.{name}"):
            changes.append(change)
    return changes


def _layouts(optimizations: list[Any]) -> dict[str, dict[str, Any]]:
    return {o.name: layout for o in optimizations if (layout := o.saved_layout())}


def _said(layout: dict[str, Any] | None) -> str:
    return "off" if layout is None else " ".join(f"{k}={v}" for k, v in layout.items())


def scenario_in(folder: Path) -> dict[str, Any] | None:
    """The scenario an earlier run wrote in ``folder`` (None: no earlier run)."""
    try:
        data = yaml.safe_load((folder / "scenario.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None
