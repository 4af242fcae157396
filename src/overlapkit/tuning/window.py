"""How many steps a trial measures: more for a setting whose steps vary more.

A run's summary gives its mean step time's relative standard error, from the
spread of the means of contiguous batches of its steps (`runtime.metrics`). A
trial of n steps with error e would need n (e / target)^2 steps for the
target error ``tune.window_se``; the window is that, between ``tune.steps``
and ``tune.longest``. The search's trials take the window the reference
trials' errors call for (their median); each setting of the race takes its
own, from its earlier trials, the same in every round so that its rounds
compare alike.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

from .config import TuneConfig


def needed_steps(steps_run: int, se_rel: float | None, target: float) -> float | None:
    """The steps a trial that ran ``steps_run`` steps with error ``se_rel`` would need for
    ``target`` (None: its error is unknown)."""
    if se_rel is None or steps_run <= 0:
        return None
    return steps_run * (se_rel / target) ** 2


def window(trials: Iterable[dict[str, Any]], tune: TuneConfig) -> int:
    """The steps to measure, from earlier trials' attributes (``steps`` run and
    ``se_rel``): the median of what each needed, within ``tune.steps`` and
    ``tune.longest``; ``tune.steps`` when none says."""
    needed = [
        n
        for attrs in trials
        if (n := needed_steps(attrs.get("steps", 0), attrs.get("se_rel"), tune.window_se))
        is not None
    ]
    if not needed:
        return tune.steps
    return max(tune.steps, min(tune.longest, math.ceil(statistics.median(needed))))
