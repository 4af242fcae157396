"""What a run's checkpoints depend on (their *setup*), recorded in their manifest:
a run that would resume them is checked against it, before any rank starts and
again by the ranks (a script calling `run_scenario` has no command line to check
first), with the same comparison."""

from __future__ import annotations

import json
from typing import Any

from ...runtime.plain_data import first_difference, value_at

# A change in any of these makes a resume load a different model, optimizer or data
# position (the step count and the learning rate may change: they train on).
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


def setup_record(scenario: dict[str, Any], layouts: dict[str, Any] | None) -> dict[str, Any]:
    """The setup of a scenario (as plain data): its `SAVED_WITH` values, and under
    ``layouts`` how its optimizations lay out their state (see
    `Optimization.saved_layout`; None: not known), as a manifest gives it back."""
    setup: dict[str, Any] = {}
    for path in SAVED_WITH:
        *parents, key = path.split(".")
        place = setup
        for part in parents:
            place = place.setdefault(part, {})
        place[key] = value_at(scenario, path)
    setup["layouts"] = layouts
    return json.loads(json.dumps(setup))  # lists, not tuples


def setup_changes(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between two setups, as ``path before -> now`` (a whole section by
    its first differing key; an optimization's layout as ``optimizations.NAME``, "off"
    where one of the two runs lacks it). Layouts count only where both are known."""
    found = [
        first_difference(value_at(before, path), value_at(now, path), path) for path in SAVED_WITH
    ]
    changes = [change for change in found if change is not None]
    was, is_now = before.get("layouts"), now.get("layouts")
    if was is None or is_now is None:
        return changes
    for name in sorted(was.keys() | is_now.keys()):
        old, new = was.get(name), is_now.get(name)
        if old is None or new is None:  # turned on or off
            changes.append(f"optimizations.{name} {_said(old)} -> {_said(new)}")
        elif change := first_difference(old, new, f"optimizations.{name}"):
            changes.append(change)
    return changes


def _said(layout: dict[str, Any] | None) -> str:
    return "off" if layout is None else " ".join(f"{k}={v}" for k, v in layout.items())
