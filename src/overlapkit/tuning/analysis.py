"""What a study measured, turned into answers: the comparison rows, each
optimization's contention curve and point, pairwise interactions, knob
importances, the policy's effect and (with two objectives) the Pareto front.

Measurements are looked up by their parameters, whichever phase ran them, so
a setting measured once serves every row that needs it. A setting measured
more than once counts by its median; the best setting is chosen among those
measured `repeats` times (the confirmed ones), so that one lucky measurement
cannot win.

Nothing is claimed that the study's own noise does not support. The noise is
estimated from every setting measured more than once, in a way that holds at
2-3 repeats: each setting's range of log-values divided by d2(n), the
range-to-sigma constant of n samples (1.128 at 2, 1.693 at 3), and the median
over settings, so one setting with a wild repeat does not set it. Two settings
differ when their medians are more than `Z` standard errors apart; a setting
whose own repeats disagree by more than `DISAGREE` times the noise is flagged
and judged by its own spread.
"""

from __future__ import annotations

import math
import statistics
import warnings
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import combinations
from typing import Any

import optuna
from optuna.trial import TrialState

from .config import TuneConfig
from .goodput import goodput, priced_efficiency
from .space import SearchSpace

UNUSED = "unused"  # the role of a trial that found the queue empty (pruned at once)
QUEUED_AGAIN = ("interrupted", "no_room")  # failures whose setting runs again
# Trials of the analysis phase (around the center) and their repeats.
ANALYSIS_ROLES = ("sweep:", "pair:", "policy", "repeat:analysis")
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

    def value(self, metric: str) -> float:
        return self.throughput if metric == "throughput" else self.goodput


@dataclass
class Analysis:
    space: SearchSpace
    metric: str  # what "best" means: throughput, or goodput (also with both objectives)
    objectives: list[str]
    measured: list[Measurement]
    failed: list[dict[str, Any]]
    pruned: int
    study: optuna.Study
    tune: TuneConfig  # repeats, and the figures goodput is priced at

    @property
    def repeats(self) -> int:
        """How many measurements make a setting confirmed."""
        return self.tune.repeats

    @classmethod
    def of(
        cls, study: optuna.Study, space: SearchSpace, tune: TuneConfig | None = None
    ) -> Analysis:
        """``tune``: the goodput figures (MTBF, restart, job length) to price the trials
        at, when they differ from the study's own (``overlapkit report --mtbf-hours``)."""
        objectives = study.user_attrs.get("objectives", ["throughput"])
        tune = tune or TuneConfig(**study.user_attrs.get("tune", {}))
        measured, failed, pruned = [], [], 0
        for t in study.get_trials(deepcopy=False):
            role = t.user_attrs.get("role", "search")
            if t.state == TrialState.COMPLETE:
                a = t.user_attrs
                measured.append(
                    Measurement(
                        t.number, role, dict(t.params), a["throughput"], _goodput(a, tune), a
                    )
                )
            elif t.state == TrialState.FAIL:
                failed.append(
                    {
                        "trial": t.number,
                        "role": role,
                        "failure": t.user_attrs.get("failure", "error"),
                        "reason": t.user_attrs.get("reason", ""),
                        "params": dict(t.params),
                    }
                )
            elif t.state == TrialState.PRUNED and role != UNUSED:
                pruned += 1
        metric = "throughput" if objectives == ["throughput"] else "goodput"
        return cls(space, metric, objectives, measured, failed, pruned, study, tune)

    # ---------------------------------------------------------------- lookups
    @cached_property
    def groups(self) -> dict[tuple[Any, ...], list[Measurement]]:
        """The measurements of each setting, sorted by the metric."""
        out: dict[tuple[Any, ...], list[Measurement]] = {}
        for m in self.measured:
            out.setdefault(setting_key(m.params), []).append(m)
        for same in out.values():
            same.sort(key=lambda m: m.value(self.metric))
        return out

    def measurements(self, params: dict[str, Any]) -> list[Measurement]:
        return self.groups.get(setting_key(params), [])

    def lookup(self, params: dict[str, Any]) -> Measurement | None:
        """The measurement of ``params`` (the median one when measured more than once)."""
        same = self.measurements(params)
        return _median(same) if same else None

    def spread(self, params: dict[str, Any], metric: str | None = None) -> Spread | None:
        """``params``' measurements of ``metric`` (the study's by default)."""
        same = self.measurements(params)
        if not same:
            return None
        return Spread(tuple(sorted(m.value(metric or self.metric) for m in same)))

    def value(self, params: dict[str, Any]) -> float | None:
        """The median of ``params``' measurements."""
        spread = self.spread(params)
        return None if spread is None else spread.median

    def ranked(self) -> list[Measurement]:
        """Each setting's median measurement, best median first."""
        medians = [_median(same) for same in self.groups.values()]
        return sorted(medians, key=lambda m: self.value(m.params), reverse=True)

    def _best_of(self, ranked: list[Measurement]) -> Measurement | None:
        """The best median among settings measured `repeats` times (among all when
        none is, or when one measurement is enough)."""
        confirmed = [m for m in ranked if len(self.measurements(m.params)) >= self.repeats]
        return (confirmed or ranked or [None])[0]

    @cached_property
    def best(self) -> Measurement | None:
        """The tuned best: it may be a setting the analysis phase found and confirmed."""
        return self._best_of(self.ranked())

    @cached_property
    def center(self) -> Measurement | None:
        """The best setting of the references and the search, judged by their own
        measurements: the analysis phase sweeps each level around it, and neither a
        better setting it finds nor its repeats of a sweep point move the center off
        the curves it measured."""
        return self.searched.best

    @cached_property
    def searched(self) -> Analysis:
        """This study without the analysis phase's trials."""
        kept = [m for m in self.measured if not m.role.startswith(ANALYSIS_ROLES)]
        return replace(self, measured=kept)

    @cached_property
    def _sigmas(self) -> list[float]:
        """Each setting measured more than once: its own relative standard deviation."""
        spreads = (self.spread(same[0].params) for same in self.groups.values())
        return [spread.sigma for spread in spreads if spread.sigma is not None]

    @property
    def noise(self) -> float | None:
        """One measurement's relative standard deviation (0.05: about +-5 %), from the
        settings measured more than once (see `NOISE_METHOD`); None when none was."""
        return statistics.median(self._sigmas) if self._sigmas else None

    @property
    def noise_settings(self) -> int:
        """How many settings the noise was estimated from."""
        return len(self._sigmas)

    def flagged(self, spread: Spread | None) -> bool:
        """Its repeats disagree by more than the noise explains."""
        if spread is None or spread.sigma is None or self.noise is None:
            return False
        return spread.sigma > DISAGREE * self.noise and spread.high / spread.low > 1.01

    def _sigma(self, spread: Spread) -> float:
        """The standard deviation to judge ``spread`` by: its own when its repeats
        disagree, else the study's noise (FLAT / Z when nothing was measured twice)."""
        if self.flagged(spread):
            return spread.sigma or 0.0
        return self.noise if self.noise is not None else FLAT / Z / math.sqrt(2)

    def differs(self, a: Spread | None, b: Spread | None) -> bool:
        """Whether the medians of ``a`` and ``b`` are further apart than the noise allows
        (more than `Z` standard errors of the difference of their log-medians)."""
        if a is None or b is None or a.median <= 0 or b.median <= 0:
            return False
        error = math.sqrt(self._sigma(a) ** 2 / a.n + self._sigma(b) ** 2 / b.n)
        return abs(math.log(a.median / b.median)) > Z * error

    def ties(self, of: Measurement | None) -> list[Measurement]:
        """The other settings whose median cannot be told apart from ``of``'s."""
        if of is None:
            return []
        mine = self.spread(of.params)
        return [
            m
            for m in self.ranked()
            if setting_key(m.params) != setting_key(of.params)
            and not self.differs(mine, self.spread(m.params))
        ]

    @property
    def baseline(self) -> Measurement | None:
        return self.lookup(self.space.setting({"scheduler.policy": "free"}))

    def alone(self, name: str) -> list[tuple[Any, Measurement | None]]:
        """``name`` alone (the others off, policy free) at each of its levels."""
        return [(v, self.lookup(params)) for v, params in self._alone_settings(name)]

    def _alone_settings(self, name: str) -> list[tuple[Any, dict[str, Any]]]:
        """(level, setting) of ``name`` alone; its "off" (where it has an on switch)
        is the baseline, everything off."""
        base = {"scheduler.policy": "free"}
        return [
            (v, self.space.setting(base) if v == "off" else self.space.setting(base, **{name: v}))
            for v in self._levels(name)
        ]

    def alone_best(self) -> dict[str, Any]:
        out = {}
        for name in self.space.optimizations:
            on = [
                (v, m)
                for v, m in self.alone(name)
                if m is not None and not _is_off(self.space, name, v)
            ]
            # Like the best: among the levels measured `repeats` times, if any is.
            confirmed = [vm for vm in on if len(self.measurements(vm[1].params)) >= self.repeats]
            if on:
                out[name] = max(confirmed or on, key=lambda vm: self.value(vm[1].params))[0]
        return out

    def _levels(self, name: str) -> list[Any]:
        level = self.space.level(name)
        values = level.values()
        return values if level.off_value is not None else ["off", *values]

    # ------------------------------------------------------------ the answers
    def reference_rows(self) -> list[tuple[str, dict[str, Any] | None, str]]:
        """(row, setting, description): baseline, each optimization alone at its
        best level, all on at full level (the naive combination)."""
        free = {"scheduler.policy": "free"}
        rows: list[tuple[str, dict[str, Any] | None, str]] = [
            ("baseline (all off)", self.space.setting(free), "")
        ]
        best_alone = self.alone_best()
        for name in self.space.optimizations:
            level = best_alone.get(name)
            setting = None if level is None else self.space.setting(free, **{name: level})
            said = "" if level is None else f"{self.space.level(name).name}={level}"
            rows.append((f"{name} alone", setting, said))
        every = {name: "max" for name in self.space.optimizations}
        rows.append(
            (
                "all on, full (naive)",
                self.space.setting(free, **every),
                "every level at its maximum, policy free",
            )
        )
        return rows

    def comparison(self) -> list[dict[str, Any]]:
        """The reference rows and the tuned best: each with its median, range and n,
        its ratio to the baseline and whether that ratio exceeds the noise, and a
        flag when its own repeats disagree."""
        base = self.baseline
        base_spread = None if base is None else self.spread(base.params)
        best = self.best
        rows = [(label, self.lookup(s) if s else None, d) for label, s, d in self.reference_rows()]
        rows.append(("tuned best", best, _describe(best.params) if best else ""))
        out = []
        for label, m, setting in rows:
            row = {
                "row": label,
                "setting": setting,
                "params": None if m is None else m.params,
                "trial": None,
                "throughput": None,
                "goodput": None,
                "vs_baseline": None,
                "beyond_noise": None,
                "disagree": False,
                "measured": 0,
                "low": None,
                "high": None,
            }
            if m is not None:
                spread = self.spread(m.params)
                row.update(
                    trial=m.number,
                    throughput=self.spread(m.params, "throughput").median,
                    goodput=self.spread(m.params, "goodput").median,
                    measured=spread.n,
                    low=spread.low,
                    high=spread.high,
                    disagree=self.flagged(spread),
                )
                if base_spread is not None and base_spread.median > 0:
                    row["vs_baseline"] = spread.median / base_spread.median
                    row["beyond_noise"] = self.differs(spread, base_spread)
            out.append(row)
        return out

    def _curve(self, settings: list[tuple[Any, dict[str, Any]]]) -> list[dict[str, Any]]:
        """(level, setting) pairs -> the measured points: level, median, range, n."""
        points = []
        for level, params in settings:
            spread = self.spread(params)
            if spread is not None:
                points.append(
                    {
                        "level": level,
                        "median": spread.median,
                        "low": spread.low,
                        "high": spread.high,
                        "n": spread.n,
                        "disagree": self.flagged(spread),
                        "values": list(spread.values),
                    }
                )
        return points

    def curves(self) -> dict[str, dict[str, Any]]:
        """Per optimization: its metric along its level alone and with the others held
        at the analysis center (the best setting of the search), and the contention
        point: the lowest level that the noise cannot tell apart from the with-others
        peak (beyond it, more overlap stops paying). When no level differs from the
        peak beyond the noise, there is no point to claim: ``flat`` is true."""
        best = self.center
        out = {}
        for name in self.space.optimizations:
            level = self.space.level(name)
            alone = self._curve(self._alone_settings(name))
            together: list[dict[str, Any]] = []
            if best is not None:
                settings = []
                for v in self._levels(name):
                    params = dict(best.params)
                    if v == "off":
                        params[f"{name}.on"] = False
                    else:
                        params[level.name] = v
                        if f"{name}.on" in params:
                            params[f"{name}.on"] = True
                    settings.append((v, params))
                together = self._curve(settings)
            with_point, flat = self._knee(together)
            alone_point, alone_flat = self._knee(alone)
            out[name] = {
                "level": level.name,
                "alone": [(p["level"], p["median"]) for p in alone],
                "with_others": [(p["level"], p["median"]) for p in together],
                "points": {"alone": alone, "with_others": together},
                "contention_point": with_point,
                "flat": flat,
                "unmeasured_above": self._unmeasured_above(name, with_point, together),
                "at_top": self._at_top(name, with_point, together),
                "peak": _peak_level(together),
                "alone_point": alone_point,
                "alone_flat": alone_flat,
                "alone_unmeasured_above": self._unmeasured_above(name, alone_point, alone),
                "alone_at_top": self._at_top(name, alone_point, alone),
                **self._drop(together),
            }
        return out

    def _unmeasured_above(self, name: str, point: Any, points: list[dict[str, Any]]) -> list[Any]:
        """The space's levels above ``point`` when none above it was measured: the
        point is then only the highest level measured, not where more overlap stops
        paying (a level above might pay more)."""
        if not _is_number(point):
            return []
        if any(_is_number(p["level"]) and p["level"] > point for p in points):
            return []
        return [v for v in self._levels(name) if _is_number(v) and v > point]

    def _at_top(self, name: str, point: Any, points: list[dict[str, Any]]) -> bool:
        """Whether ``point`` is the highest level the space has, below which every
        measured level was worse beyond the noise: the curve still rose at the top of
        the range, so it shows no level where more stops paying."""
        if not _is_number(point) or len(points) < 2:
            return False
        return not [v for v in self._levels(name) if _is_number(v) and v > point]

    def _knee(self, points: list[dict[str, Any]]) -> tuple[Any, bool]:
        """(the lowest level the noise cannot tell apart from the peak, whether every
        level is within the noise of the peak)."""
        if not points:
            return None, False
        peak = _spread_of(max(points, key=lambda p: p["median"]))
        equal = [p for p in points if not self.differs(_spread_of(p), peak)]
        flat = len(equal) == len(points) and len(points) > 1
        ordered = sorted(equal, key=lambda p: _order(p["level"]))
        return ordered[0]["level"], flat

    def _drop(self, points: list[dict[str, Any]]) -> dict[str, Any]:
        """How far the highest level is below the peak (0.1 = 10 % lower) and whether
        that drop exceeds the noise."""
        numeric = [p for p in points if _is_number(p["level"])]
        if len(numeric) < 2:  # one level: nothing to be below
            return {"drop_at_max": None, "drop_beyond_noise": False}
        peak = max(numeric, key=lambda p: p["median"])
        last = max(numeric, key=lambda p: p["level"])
        drop = 1 - last["median"] / peak["median"] if peak["median"] > 0 else None
        beyond = self.differs(_spread_of(last), _spread_of(peak))
        return {"drop_at_max": drop, "drop_beyond_noise": beyond}

    def interactions(self) -> list[dict[str, Any]]:
        """For each pair at their alone-best levels: each one's gain over the
        baseline alone, their gain together, and the interaction
        (together / (gain A x gain B) - 1: below 0, turning one on takes from the
        other), claimed (``beyond_noise``) only where it exceeds the noise of the four
        medians it is made of."""
        base, best_alone, out = self.baseline, self.alone_best(), []
        if base is None or self.value(base.params) <= 0:
            return out
        free = {"scheduler.policy": "free"}
        for first, second in combinations(self.space.optimizations, 2):
            if first not in best_alone or second not in best_alone:
                continue
            settings = [
                base.params,
                self.space.setting(free, **{first: best_alone[first]}),
                self.space.setting(free, **{second: best_alone[second]}),
                self.space.setting(free, **{first: best_alone[first], second: best_alone[second]}),
            ]
            spreads = [self.spread(p) for p in settings]
            if any(sp is None or sp.median <= 0 for sp in spreads):
                continue
            b, one, two, both = (sp.median for sp in spreads)
            interaction = both * b / (one * two)
            error = math.sqrt(sum(self._sigma(sp) ** 2 / sp.n for sp in spreads))
            out.append(
                {
                    "a": first,
                    "b": second,
                    "gain_a": one / b,
                    "gain_b": two / b,
                    "gain_together": both / b,
                    "interaction": interaction - 1,
                    "beyond_noise": abs(math.log(interaction)) > Z * error,
                }
            )
        return out

    def importances(self) -> dict[str, float]:
        """Optuna's importance evaluator (PED-ANOVA by default) on the metric (negated:
        the evaluator ranks what makes its target low). Only the knobs that took more
        than one value among the measured trials: PED-ANOVA ranks one that never varied
        (its every trial refused, say) above those that did."""
        value = {m.number: m.value(self.metric) for m in self.measured}
        seen: dict[str, set[str]] = {}
        for m in self.measured:
            for name, v in m.params.items():
                seen.setdefault(name, set()).add(repr(v))
        varied = [name for name, values in seen.items() if len(values) > 1]
        if not varied:
            return {}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "achieve low target": negated
                return optuna.importance.get_param_importances(
                    self.study, params=varied, target=lambda t: -value[t.number]
                )
        except (RuntimeError, ValueError, ZeroDivisionError):
            return {}  # too few trials, or a parameter that never varied

    def policy_effect(self) -> dict[str, float]:
        """The analysis center's metric under each scheduler policy."""
        best = self.center
        if best is None or "scheduler.policy" not in best.params:
            return {}
        out = {}
        for choice in self.space.grid()["scheduler.policy"]:
            value = self.value({**best.params, "scheduler.policy": choice})
            if value is not None:
                out[choice] = value
        return out

    def pareto(self) -> list[Measurement]:
        """With both objectives: the trials no other beats on one without losing on
        the other (from the goodput priced here, which may differ from the study's)."""
        if len(self.objectives) < 2:
            return []
        return [m for m in self.measured if not any(_dominates(o, m) for o in self.measured)]


def _goodput(attrs: dict[str, Any], tune: TuneConfig) -> float:
    """A trial's goodput at ``tune``'s figures, from its throughput, checkpoint
    interval and persist time (the recorded value if it lacks those)."""
    if "checkpoint_interval_s" not in attrs:
        return attrs["goodput"]
    share = priced_efficiency(attrs["checkpoint_interval_s"], attrs["persist_s"], tune)
    return goodput(attrs["throughput"], share)


def _dominates(a: Measurement, b: Measurement) -> bool:
    return (
        a.throughput >= b.throughput
        and a.goodput >= b.goodput
        and (a.throughput > b.throughput or a.goodput > b.goodput)
    )


def _is_off(space: SearchSpace, name: str, value: Any) -> bool:
    return value == "off" or value == space.level(name).off_value


def _median(same: list[Measurement]) -> Measurement:
    """The median of measurements sorted by the metric (the lower one of an even
    count: a setting does not gain from being measured twice)."""
    return same[(len(same) - 1) // 2]


def stops_paying(curve: dict[str, Any], alone: bool = False) -> Any:
    """Where more overlap stops paying on a curve (with the others at their best, or
    ``alone``), as every report says it: the level, "within noise" (no level differs
    from the best), or that the levels above the best measured were not measured."""
    prefix = "alone_" if alone else ""
    point = curve[f"{prefix}point" if alone else "contention_point"]
    if point is None:  # no level of the curve was measured
        return "not measured"
    if curve[f"{prefix}flat"]:
        return "within noise"
    above = curve.get(f"{prefix}unmeasured_above")
    if above:
        return f"not measured above {point}"
    if curve.get(f"{prefix}at_top"):
        return f"not in the range: best at its top, {point}"
    return point


def _peak_level(points: list[dict[str, Any]]) -> Any:
    """The level of a curve's highest median (None: no points)."""
    return max(points, key=lambda p: p["median"])["level"] if points else None


def _order(value: Any) -> Any:
    return (
        (0, value)
        if isinstance(value, (int, float)) and not isinstance(value, bool)
        else (1, str(value))
    )


def _spread_of(point: dict[str, Any]) -> Spread:
    return Spread(tuple(point["values"]))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _describe(params: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()
    )
