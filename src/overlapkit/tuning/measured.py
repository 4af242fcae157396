"""What a study measured, as data: each completed trial's measurement, the
measurements of one setting (their median, range and own noise), and the
trials' roles.

The noise of measurements made at different times (the search, one setting at
a time) is estimated from every setting measured more than once, in a way
that holds at 2-3 repeats: each setting's range of log-values divided by d2(n),
the range-to-sigma constant of n samples (1.128 at 2, 1.693 at 3), and the
median over settings, so one setting with a wild repeat does not set it.
Settings measured side by side, in rounds, are judged by `paired` instead.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

UNUSED = "unused"  # the role of a trial that found the queue empty (pruned at once)
QUEUED_AGAIN = ("interrupted", "no_room")  # failures whose setting runs again
# Trials of the analysis phase (around the center) and their repeats.
ANALYSIS_ROLES = ("sweep:", "pair:", "policy", "repeat:analysis")
RACE = "race"  # a round of the confirm phase's race
CONTROL = "control"  # the search's re-measurement of the control setting (drift)
PROBE = "probe"  # a trial that measures a checkpoint's cost (checkpoints every few steps)
# The study's attributes: the race's settings and rows, the model's checkpoint plan (from
# the probes alone; with the pick on), the search trials' window.
RACE_ATTR = "race"
PLAN_ATTR = "checkpoint_plan"
PICK_PLAN_ATTR = "checkpoint_plan_pick"
SEARCH_STEPS_ATTR = "search_steps"
FLAT = 0.02  # with no noise estimate (nothing measured twice), closer than 2 % is "equal"
Z = 2.0  # a difference is claimed beyond this many standard errors
DISAGREE = 3.0  # a setting whose own spread is this many times the noise: its repeats disagree
# d2(n): the expected range of n normal samples in standard deviations.
D2 = {2: 1.128, 3: 1.693, 4: 2.059, 5: 2.326, 6: 2.534, 7: 2.704, 8: 2.847, 9: 2.970, 10: 3.078}
NOISE_METHOD = (
    "each setting measured 2+ times: the range of its log-values / d2(n) "
    "(1.128 at n=2, 1.693 at n=3); the median over those settings"
)


def setting_key(params: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(sorted((k, round(v, 9) if isinstance(v, float) else v) for k, v in params.items()))


@dataclass(frozen=True)
class Spread:
    """One setting's measurements of one metric: median, range, n and own sigma."""

    values: tuple[float, ...]  # sorted

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return self.values[0]

    @property
    def high(self) -> float:
        return self.values[-1]

    @property
    def sigma(self) -> float | None:
        """Relative standard deviation from this setting's own range (None below n=2)."""
        if self.n < 2 or self.low <= 0:
            return None
        return math.log(self.high / self.low) / D2.get(self.n, D2[10])


@dataclass
class Measurement:
    number: int
    role: str
    params: dict[str, Any]
    throughput: float
    goodput: float
    attrs: dict[str, Any] = field(default_factory=dict)
    started: float | None = None  # when the trial started (seconds since the epoch)

    @property
    def block(self) -> str | None:
        """The round it was measured in, side by side with others (None: alone)."""
        return self.attrs.get("block")

    def value(self, metric: str) -> float:
        return self.throughput if metric == "throughput" else self.goodput
