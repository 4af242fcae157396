"""The race of the confirm phase: the search's finalists and the reference rows,
measured side by side in rounds until the best is told apart from the rest.

Each round measures every setting still in the race once, in an order rotated
by one each round (so no setting always runs first, or right after the same
one). After each round from round ``tune.repeats`` on (2 at the least: one
round has no noise to judge by), the rounds are fitted together
(`paired.PairedFit`) and every setting that the race's best beats beyond the
noise leaves the race: it needs no more measurements to be ruled out. The race
stops when one setting is left (the best is separated from the runner-up), or
after its last round (``tune.max_repeats``), whichever comes first. The best is
held against all the others at once, at 95 % for them together (Bonferroni):
each setting the rule could pick is dropped by chance less often, so that two
studies the noise cannot separate land on the same simplest setting more often.
Each round is a new look; the rule, not the look, settles near-ties.

The pick follows a stated rule, so that two studies that cannot tell settings
apart still agree: among the settings within noise of the best (the best
included), the simplest, the one with the fewest optimizations on, then the
lowest levels, then the plainer policy (free, then priority, then partition)
and its knobs at their first values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..runtime import POLICIES
from .paired import Key, PairedFit
from .space import SCHEDULER, SearchSpace


@dataclass(frozen=True)
class RaceStatus:
    """Where the race stands after the rounds fitted."""

    best: Key  # the highest effect among the settings still in the race
    out: tuple[Key, ...]  # those the best beats beyond the noise (they leave the race)
    equivalent: tuple[Key, ...]  # the others: within noise of the best (the best first)
    judged: bool  # the noise is known (two rounds or more): else nothing is told apart

    @property
    def separated(self) -> bool:
        """The best is beyond the noise of every other setting of the race."""
        return self.judged and len(self.equivalent) == 1

    def pick(self, complexity: Callable[[Key], tuple[Any, ...]]) -> Key:
        """The simplest setting within noise of the best (the best, before the noise
        is known)."""
        return simplest(self.equivalent, complexity) if self.judged else self.best


def race_status(fit: PairedFit, racing: Sequence[Key]) -> RaceStatus:
    """The best of ``racing`` (keys in ``fit``) and which of them it beats: beyond the
    noise of all its comparisons together (Bonferroni over the others), so that a
    setting leaves the race, and falls out of the pick's choice, by chance 5 % of the
    time in all, not 5 % for each."""
    best = max(racing, key=fit.effect)
    judged = fit.sigma is not None
    others = len(racing) - 1
    out = tuple(k for k in racing if k != best and fit.beats(best, k, others))
    within = sorted((k for k in racing if k != best and k not in out), key=fit.effect)
    return RaceStatus(best, out, (best, *reversed(within)), judged)


def round_order(keys: Sequence[Key], round_: int) -> list[Key]:
    """``keys`` rotated by ``round_`` (counted from 0): each round starts one further on."""
    if not keys:
        return []
    turn = round_ % len(keys)
    return [*keys[turn:], *keys[:turn]]


def simplest(keys: Sequence[Key], complexity: Callable[[Key], tuple[Any, ...]]) -> Key:
    """The simplest of ``keys`` (the first of equals: the best of them, when the
    best comes first)."""
    return min(keys, key=complexity)


def complexity(space: SearchSpace, params: dict[str, Any]) -> tuple[Any, ...]:
    """How much a setting turns on, to order settings the noise cannot tell apart:
    (optimizations on, the sum of their levels as a share of each one's range, the
    policy's place in free/priority/partition, the policy's knobs away from their
    first value)."""
    on = [name for name in space.optimizations if space.is_on(params, name)]
    levels = 0.0
    for name in on:
        level = space.level(name)
        values = level.values()
        value = params.get(level.name)
        if level.knob == "intensity":
            levels += float(value)
        elif level.kind != "categorical" and level.high != level.low:  # a numeric range
            levels += (float(value) - float(level.low)) / (float(level.high) - float(level.low))
        elif value in values and len(values) > 1:
            levels += values.index(value) / (len(values) - 1)
    policies = list(POLICIES)
    policy = params.get(f"{SCHEDULER}.policy", policies[0])
    rank = policies.index(policy) if policy in policies else len(policies)
    knobs = sum(
        1
        for d in space.dimensions
        if d.owner == SCHEDULER
        and d.knob != "policy"
        and policy == "partition"
        and params.get(d.name) != d.values()[0]
    )
    return (len(on), round(levels, 9), rank, knobs)
