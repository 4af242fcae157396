"""What a study measured, turned into answers: the comparison rows, each
optimization's contention curve and point, pairwise interactions, knob
importances, the policy's effect and (with two objectives) the Pareto front.

Measurements are looked up by their parameters, whichever phase ran them, so
a setting measured once serves every row that needs it. Settings measured side
by side in rounds (the confirm phase's race, the analysis round around the
pick) are valued and compared by their paired fit (`paired`): a round that ran
slow moves every setting in it alike. Any other comparison falls back to the
settings' medians and the study's noise across time (`measured`), after the
drift the search's control measurements found (`drift`), when there is one
beyond the noise. The tuned best is the race's pick: the simplest setting
within noise of the race's best (`race`).

Nothing is claimed that the noise does not support: two settings differ when
their paired log-ratio exceeds Student's t (97.5 %) standard errors, or, not
measured side by side, when their medians are more than `Z` standard errors
apart; a setting whose own repeats disagree by more than `DISAGREE` times the
noise is flagged and judged by its own spread.
"""

from __future__ import annotations

import math
import statistics
import warnings
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import combinations
from typing import Any

import optuna
from optuna.trial import TrialState

from .checkpoint_model import CheckpointPlan
from .config import TuneConfig
from .drift import Drift, drift_of
from .goodput import goodput, priced_efficiency
from .measured import (  # noqa: F401  (the study's roles, for its other modules)
    ANALYSIS_ROLES,
    CONTROL,
    DISAGREE,
    FLAT,
    NOISE_METHOD,
    PICK_PLAN_ATTR,
    PLAN_ATTR,
    PROBE,
    QUEUED_AGAIN,
    RACE,
    RACE_ATTR,
    SEARCH_STEPS_ATTR,
    UNUSED,
    Measurement,
    Spread,
    Z,
    setting_key,
)
from .paired import PairedFit
from .race import RaceStatus, complexity, race_status
from .space import SearchSpace


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
    probes: list[Measurement]  # the checkpoint's cost probes (not settings' measurements)

    @property
    def repeats(self) -> int:
        """How many measurements make a setting confirmed (without a race)."""
        return self.tune.repeats

    @classmethod
    def of(
        cls, study: optuna.Study, space: SearchSpace, tune: TuneConfig | None = None
    ) -> Analysis:
        """``tune``: the goodput figures (MTBF, restart, job length) to price the trials
        at, when they differ from the study's own (``overlapkit report --mtbf-hours``)."""
        objectives = study.user_attrs.get("objectives", ["throughput"])
        tune = tune or TuneConfig(**study.user_attrs.get("tune", {}))
        plan = plan_at(study, tune)
        measured, probes, failed, pruned = [], [], [], 0
        for t in study.get_trials(deepcopy=False):
            role = t.user_attrs.get("role", "search")
            if t.state == TrialState.COMPLETE:
                a = t.user_attrs
                started = t.datetime_start.timestamp() if t.datetime_start else None
                m = Measurement(
                    t.number,
                    role,
                    dict(t.params),
                    a["throughput"],
                    _goodput(a, tune, plan),
                    a,
                    started,
                )
                (probes if role == PROBE else measured).append(m)
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
        return cls(space, metric, objectives, measured, failed, pruned, study, tune, probes)

    @cached_property
    def plan(self) -> CheckpointPlan | None:
        """The checkpoint interval the model chose (None: the study searched it, or had
        no checkpoints), at this analysis' goodput figures."""
        return plan_at(self.study, self.tune)

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

    def spread(
        self, params: dict[str, Any], metric: str | None = None, corrected: bool = False
    ) -> Spread | None:
        """``params``' measurements of ``metric`` (the study's by default); ``corrected``:
        each outside the side-by-side rounds divided by the machine's drift then."""
        same = self.measurements(params)
        if not same:
            return None
        metric = metric or self.metric
        values = (self._corrected(m, metric) if corrected else m.value(metric) for m in same)
        return Spread(tuple(sorted(values)))

    def behind(self, params: dict[str, Any], metric: str | None = None) -> Spread | None:
        """The measurements ``params``' value comes from: those side by side when it
        was measured so (the paired fit's), else all of them."""
        metric = metric or self.metric
        fit, key = self.paired_fit(metric), setting_key(params)
        if fit is None or key not in fit:
            return self.spread(params, metric)
        same = [m.value(metric) for m in self.measurements(params) if m.block is not None]
        return Spread(tuple(sorted(same)))

    def value(self, params: dict[str, Any], metric: str | None = None) -> float | None:
        """``params``' value: from the paired fit when it was measured side by side
        (in an average round), else the median of its measurements (after drift)."""
        metric = metric or self.metric
        fit, key = self.paired_fit(metric), setting_key(params)
        if fit is not None and key in fit:
            return fit.level(key)
        spread = self.spread(params, metric, corrected=True)
        return None if spread is None else spread.median

    def ranked(self) -> list[Measurement]:
        """Each setting's median measurement, best value first."""
        medians = [_median(same) for same in self.groups.values()]
        return sorted(medians, key=lambda m: self.value(m.params), reverse=True)

    def _best_of(self, ranked: list[Measurement]) -> Measurement | None:
        """The best median among settings measured `repeats` times (among all when
        none is, or when one measurement is enough)."""
        confirmed = [m for m in ranked if len(self.measurements(m.params)) >= self.repeats]
        return (confirmed or ranked or [None])[0]

    @cached_property
    def best(self) -> Measurement | None:
        """The tuned best: the race's pick (the simplest setting within noise of the
        race's best); without a race, the best median among confirmed settings."""
        if self.race is not None:
            pick = self.race.pick(self._complexity)
            return next(_median(same) for key, same in self.groups.items() if key == pick)
        return self._best_of(self.ranked())

    def _complexity(self, key: tuple[Any, ...]) -> tuple[Any, ...]:
        return complexity(self.space, self.params_of(key))

    @cached_property
    def race(self) -> RaceStatus | None:
        """The race of the confirm phase, judged on every round it ran (not on the
        analysis phase's round, which does not move the pick); None: no race."""
        fit = self.searched.paired
        chosen = self.study.user_attrs.get(RACE_ATTR, {}).get("candidates", [])
        candidates = [setting_key(p) for p in chosen]
        racing = [k for k in candidates if fit is not None and k in fit and k in self.groups]
        return race_status(fit, racing) if racing else None

    def params_of(self, key: tuple[Any, ...]) -> dict[str, Any]:
        """The setting of ``key``, its parameters in the space's order."""
        same = self.groups.get(key)
        return dict(same[0].params) if same else dict(key)

    @cached_property
    def center(self) -> Measurement | None:
        """The setting the analysis phase sweeps each level around: the tuned best
        before that phase (the race's pick), so that neither a setting it finds nor
        its measurements move the center off the curves it measured."""
        return self.searched.best

    @cached_property
    def searched(self) -> Analysis:
        """This study without the analysis phase's trials."""
        kept = [m for m in self.measured if not m.role.startswith(ANALYSIS_ROLES)]
        return replace(self, measured=kept)

    # ------------------------------------------------------------------ noise
    def paired_fit(self, metric: str | None = None) -> PairedFit | None:
        """The fit of every setting measured side by side, in rounds (see `paired`)."""
        return self._paired_fits.get(metric or self.metric)

    @property
    def paired(self) -> PairedFit | None:
        return self.paired_fit()

    @cached_property
    def _paired_fits(self) -> dict[str, PairedFit | None]:
        blocked = [m for m in self.measured if m.block]
        return {
            metric: PairedFit.of((setting_key(m.params), m.block, m.value(metric)) for m in blocked)
            for metric in ("throughput", "goodput")
        }

    @cached_property
    def drift(self) -> Drift | None:
        """The machine's drift: the control setting's measurements outside the rounds
        (the reference baseline, then the search's controls) against time."""
        control = setting_key(self.space.setting({"scheduler.policy": "free"}))
        points = [
            (m.started, m.throughput)  # the machine's speed (goodput is a share of it)
            for m in self.measured
            if m.role in ("baseline", CONTROL)  # (at one window: a search trial's may differ)
            and m.block is None
            and m.started is not None
            and setting_key(m.params) == control
        ]
        return drift_of(points)

    def _corrected(self, m: Measurement, metric: str) -> float:
        value = m.value(metric)
        if m.block is not None or m.started is None or self.drift is None:
            return value
        return value / self.drift.factor(m.started)

    @cached_property
    def _sigmas(self) -> list[float]:
        """Each setting measured more than once: its own relative standard deviation."""
        spreads = (self.spread(same[0].params, corrected=True) for same in self.groups.values())
        return [spread.sigma for spread in spreads if spread.sigma is not None]

    @property
    def noise(self) -> float | None:
        """One measurement's relative standard deviation across the study (0.05: about
        +-5 %), from the settings measured more than once (see `NOISE_METHOD`); None
        when none was."""
        return statistics.median(self._sigmas) if self._sigmas else None

    @property
    def noise_settings(self) -> int:
        """How many settings the noise was estimated from."""
        return len(self._sigmas)

    @property
    def paired_noise(self) -> float | None:
        """One measurement's noise within the side-by-side rounds (the rounds' own
        drift taken out; log scale, about relative)."""
        fit = self.paired
        return None if fit is None else fit.sigma

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

    def differs(
        self, a: dict[str, Any] | None, b: dict[str, Any] | None, comparisons: int = 1
    ) -> bool:
        """Whether settings ``a`` and ``b`` differ beyond the noise: paired, when both
        were measured side by side; else their medians (after drift) are more than `Z`
        standard errors of the difference of their log-medians apart. ``comparisons``:
        of that many claims made together (a curve's levels against its peak), the
        bound for all of them at once (Bonferroni's)."""
        if a is None or b is None:
            return False
        fit, ka, kb = self.paired, setting_key(a), setting_key(b)
        if fit is not None and fit.sigma is not None and ka in fit and kb in fit:
            return fit.differs(ka, kb, comparisons)
        bound = max(Z, statistics.NormalDist().inv_cdf(1 - 0.025 / max(1, comparisons)))
        spreads = self.spread(a, corrected=True), self.spread(b, corrected=True)
        return self._medians_differ(*spreads, bound)

    def ratio(
        self, a: dict[str, Any], b: dict[str, Any], metric: str | None = None
    ) -> tuple[float, float, float] | None:
        """a / b of ``metric`` with its interval (low, high): paired, when both were
        measured side by side (t(df) standard errors), else from their medians and the
        noise (`Z` standard errors); None when either is unmeasured."""
        fit, ka, kb = self.paired_fit(metric), setting_key(a), setting_key(b)
        if fit is not None and fit.sigma is not None and ka in fit and kb in fit:
            ratio, half = fit.ratio(ka, kb), fit.bound * (fit.se(ka, kb) or 0.0)
            return ratio, ratio * math.exp(-half), ratio * math.exp(half)
        sa, sb = self.spread(a, metric, corrected=True), self.spread(b, metric, corrected=True)
        if sa is None or sb is None or sa.median <= 0 or sb.median <= 0:
            return None
        ratio = sa.median / sb.median
        half = Z * math.sqrt(self._sigma(sa) ** 2 / sa.n + self._sigma(sb) ** 2 / sb.n)
        return ratio, ratio * math.exp(-half), ratio * math.exp(half)

    def _medians_differ(self, a: Spread | None, b: Spread | None, bound: float = Z) -> bool:
        if a is None or b is None or a.median <= 0 or b.median <= 0:
            return False
        error = math.sqrt(self._sigma(a) ** 2 / a.n + self._sigma(b) ** 2 / b.n)
        return abs(math.log(a.median / b.median)) > bound * error

    def ties(self, of: Measurement | None) -> list[Measurement]:
        """The other settings that cannot be told apart from ``of``: of the race, when
        ``of`` is its pick; else every setting whose value is within noise of it."""
        if of is None:
            return []
        mine = setting_key(of.params)
        if self.race is not None and mine in self.race.equivalent:
            keys = [k for k in self.race.equivalent if k != mine]
            return [_median(self.groups[k]) for k in keys]
        return [
            m
            for m in self.ranked()
            if setting_key(m.params) != mine and not self.differs(of.params, m.params)
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
        """Each optimization's best level alone: the race's row once a race chose it,
        else the best value among the levels measured `repeats` times (if any is)."""
        raced = self.study.user_attrs.get(RACE_ATTR, {}).get("alone", {})
        out = {}
        for name in self.space.optimizations:
            if name in raced:
                out[name] = raced[name]
                continue
            on = [
                (v, m)
                for v, m in self.alone(name)
                if m is not None and not _is_off(self.space, name, v)
            ]
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
        # With the model's checkpoints, every row (the baseline too) checkpoints at its interval.
        label = "baseline (all off)" if self.plan is None else "baseline (checkpoints only)"
        rows: list[tuple[str, dict[str, Any] | None, str]] = [
            (label, self.space.setting(free), "")
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
        """The reference rows and the tuned best: each with its value (paired, when
        measured side by side; else its median), range and n, its ratio to the baseline
        and whether that ratio exceeds the noise, and a flag when its own repeats
        disagree."""
        base = self.baseline
        best = self.best
        rows = [(label, self.lookup(s) if s else None, d) for label, s, d in self.reference_rows()]
        rows.append(("tuned best", best, _describe(best.params) if best else ""))
        fit = self.paired
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
                "vs_baseline_interval": None,
                "throughput_vs_baseline": None,  # (ratio, low, high)
                "beyond_noise": None,
                "disagree": False,
                "measured": 0,
                "side_by_side": 0,
                "low": None,
                "high": None,
            }
            if m is not None:
                spread = self.behind(m.params)
                key = setting_key(m.params)
                row.update(
                    trial=m.number,
                    throughput=self.value(m.params, "throughput"),
                    goodput=self.value(m.params, "goodput"),
                    measured=spread.n,
                    side_by_side=fit.counts.get(key, 0) if fit is not None else 0,
                    low=spread.low,
                    high=spread.high,
                    disagree=self.flagged(spread) and not (fit is not None and key in fit),
                )
                ratio = None if base is None else self.ratio(m.params, base.params)
                if ratio is not None:
                    row["vs_baseline"] = ratio[0]
                    row["vs_baseline_interval"] = [ratio[1], ratio[2]]
                    row["throughput_vs_baseline"] = self.ratio(m.params, base.params, "throughput")
                    row["beyond_noise"] = self.differs(m.params, base.params)
            out.append(row)
        return out

    def _curve(self, settings: list[tuple[Any, dict[str, Any]]]) -> list[dict[str, Any]]:
        """(level, setting) pairs -> the measured points: level, value, range, n."""
        points = []
        for level, params in settings:
            spread = self.behind(params)
            if spread is not None:
                points.append(
                    {
                        "level": level,
                        "median": self.value(params),
                        "low": spread.low,
                        "high": spread.high,
                        "n": spread.n,
                        "disagree": self.flagged(spread),
                        "values": list(spread.values),
                        "params": params,
                    }
                )
        for point in points:  # relative to the curve's lowest level, with its interval
            ratio = self.ratio(point["params"], points[0]["params"])
            point["relative"] = list(ratio) if ratio is not None else None
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
        peak = max(points, key=lambda p: p["median"])
        # Every other level against the peak at once: claimed together (Bonferroni).
        others = max(1, len(points) - 1)
        equal = [p for p in points if not self.differs(p["params"], peak["params"], others)]
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
        beyond = self.differs(last["params"], peak["params"])
        return {"drop_at_max": drop, "drop_beyond_noise": beyond}

    def interactions(self) -> list[dict[str, Any]]:
        """For each pair at their alone-best levels: each one's gain over the
        baseline alone, their gain together, and the interaction
        (together / (gain A x gain B) - 1: below 0, turning one on takes from the
        other), claimed (``beyond_noise``) only where it exceeds the noise of the four
        values it is made of (paired, when all four were measured side by side)."""
        base, best_alone, out = self.baseline, self.alone_best(), []
        if base is None or not self.value(base.params):
            return out
        free = {"scheduler.policy": "free"}
        fit = self.paired
        for first, second in combinations(self.space.optimizations, 2):
            if first not in best_alone or second not in best_alone:
                continue
            settings = [
                base.params,
                self.space.setting(free, **{first: best_alone[first]}),
                self.space.setting(free, **{second: best_alone[second]}),
                self.space.setting(free, **{first: best_alone[first], second: best_alone[second]}),
            ]
            values = [self.value(p) for p in settings]
            if any(not v or v <= 0 for v in values):
                continue
            b, one, two, both = values
            interaction = both * b / (one * two)
            keys = [setting_key(p) for p in settings]
            if fit is not None and fit.sigma is not None and all(k in fit for k in keys):
                weights: dict[Any, float] = {}
                for key, weight in zip(keys, (1.0, -1.0, -1.0, 1.0), strict=True):
                    weights[key] = weights.get(key, 0.0) + weight
                estimate, se = fit.contrast(weights)
                beyond = se is not None and abs(estimate) > fit.bound * se
            else:
                spreads = [self.spread(p, corrected=True) for p in settings]
                error = math.sqrt(sum(self._sigma(sp) ** 2 / sp.n for sp in spreads))
                beyond = abs(math.log(interaction)) > Z * error
            out.append(
                {
                    "a": first,
                    "b": second,
                    "gain_a": one / b,
                    "gain_b": two / b,
                    "gain_together": both / b,
                    "interaction": interaction - 1,
                    "beyond_noise": beyond,
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
                    self.study, params=varied, target=lambda t: -value.get(t.number, math.nan)
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


def _goodput(attrs: dict[str, Any], tune: TuneConfig, plan: CheckpointPlan | None) -> float:
    """A trial's goodput at ``tune``'s figures: from its throughput and either the
    model's checkpoint interval and cost (``checkpoint_model``: `CheckpointPlan.price`,
    as the trial was priced) or its own checkpoint interval and persist time (the
    recorded value if it lacks those)."""
    if attrs.get("checkpoint_model") and plan is not None:
        steps = attrs.get("steps") or 0
        runtime = attrs.get("runtime_s") or steps * attrs["step_time_s"]
        taken = attrs.get("checkpoints_in_window", 0)
        return plan.price(attrs["throughput"], runtime, steps, taken)["goodput"]
    if "checkpoint_interval_s" not in attrs:
        return attrs["goodput"]
    share = priced_efficiency(attrs["checkpoint_interval_s"], attrs["persist_s"], tune)
    return goodput(attrs["throughput"], share)


def plan_at(study: optuna.Study, tune: TuneConfig) -> CheckpointPlan | None:
    """The study's checkpoint plan (None: none), its goodput figures those of ``tune``
    (the interval follows the MTBF; the measured cost stays)."""
    recorded = study.user_attrs.get(PLAN_ATTR)
    if not recorded:
        return None
    return replace(
        CheckpointPlan.from_dict(recorded),
        mtbf_s=tune.mtbf_hours * 3600,
        restart_s=tune.restart_s,
        job_s=tune.job_hours * 3600,
    )


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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _describe(params: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()
    )
