"""What a study measured, turned into answers: the comparison rows, each
optimization's contention curve and point, pairwise interactions, knob
importances, the policy's effect and (with two objectives) the Pareto front.

Measurements are looked up by their parameters, whichever phase ran them, so
a setting measured once serves every row that needs it. A setting measured
more than once counts by its median; the best setting is chosen among those
measured `repeats` times (the confirmed ones), so that one lucky measurement
cannot win.
"""

from __future__ import annotations

import statistics
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from itertools import combinations
from typing import Any

import optuna
from optuna.trial import TrialState

from .config import TuneConfig
from .goodput import goodput, priced_efficiency
from .space import SearchSpace

UNUSED = "unused"  # the role of a trial that found the queue empty (pruned at once)
# Trials of the analysis phase (around the center) and their repeats.
ANALYSIS_ROLES = ("sweep:", "pair:", "policy", "repeat:analysis")
FLAT = 0.02  # a curve within 2 % of its peak (or within the noise) has stopped paying


def setting_key(params: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(sorted((k, round(v, 9) if isinstance(v, float) else v) for k, v in params.items()))


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

    def ranked(self, searched: bool = False) -> list[Measurement]:
        """Each setting's median measurement, best first; ``searched``: only the
        settings that the references or the search measured (not the analysis)."""
        medians = [
            _median(same)
            for same in self.groups.values()
            if not searched or any(not m.role.startswith(ANALYSIS_ROLES) for m in same)
        ]
        return sorted(medians, key=lambda m: m.value(self.metric), reverse=True)

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
        """The best setting of the references and the search: the analysis phase
        sweeps each level around it (so its curves stay put when that finds a better one)."""
        return self._best_of(self.ranked(searched=True))

    @cached_property
    def noise(self) -> float | None:
        """How much one setting's measurements vary: the median over repeated
        settings of half their range relative to their median (0.05 = +-5 %)."""
        spreads = [
            (same[-1].value(self.metric) - same[0].value(self.metric))
            / 2
            / _median(same).value(self.metric)
            for same in self.groups.values()
            if len(same) > 1 and _median(same).value(self.metric) > 0
        ]
        return statistics.median(spreads) if spreads else None

    @property
    def tolerance(self) -> float:
        """Levels this close to a curve's peak count as equal to it."""
        return max(FLAT, self.noise or 0.0)

    @property
    def baseline(self) -> Measurement | None:
        return self.lookup(self.space.setting({"scheduler.policy": "free"}))

    def alone(self, name: str) -> list[tuple[Any, Measurement | None]]:
        """``name`` alone (the others off, policy free) at each of its levels."""
        base = {"scheduler.policy": "free"}
        return [(v, self.lookup(self.space.setting(base, **{name: v}))) for v in self._levels(name)]

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
                out[name] = max(confirmed or on, key=lambda vm: vm[1].value(self.metric))[0]
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
            rows.append((f"{name} alone", setting, f"{self.space.level(name).name}={level}"))
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
        """The reference rows and the tuned best, each with its median, how many
        times it was measured and the range of those measurements."""
        base = self.baseline
        best = self.best
        rows = [(label, self.lookup(s) if s else None, d) for label, s, d in self.reference_rows()]
        rows.append(("tuned best", best, _describe(best.params) if best else ""))
        out = []
        for label, m, setting in rows:
            row = {
                "row": label,
                "setting": setting,
                "trial": None,
                "throughput": None,
                "goodput": None,
                "vs_baseline": None,
                "measured": 0,
                "low": None,
                "high": None,
            }
            if m is not None:
                same = self.measurements(m.params)
                row.update(
                    trial=m.number,
                    throughput=m.throughput,
                    goodput=m.goodput,
                    measured=len(same),
                    low=same[0].value(self.metric),
                    high=same[-1].value(self.metric),
                )
                if base is not None and base.value(self.metric) > 0:
                    row["vs_baseline"] = m.value(self.metric) / base.value(self.metric)
            out.append(row)
        return out

    def curves(self) -> dict[str, dict[str, Any]]:
        """Per optimization: its metric along its level alone and with the others
        held at the analysis center (the best setting of the search), and the contention point: the lowest level within
        `tolerance` of the with-others peak (beyond it, more overlap stops paying)."""
        best = self.center
        out = {}
        for name in self.space.optimizations:
            level = self.space.level(name)
            alone = [(v, m.value(self.metric)) for v, m in self.alone(name) if m is not None]
            together: list[tuple[Any, float]] = []
            if best is not None:
                for v in self._levels(name):
                    params = dict(best.params)
                    if v == "off":
                        params[f"{name}.on"] = False
                    else:
                        params[level.name] = v
                        if f"{name}.on" in params:
                            params[f"{name}.on"] = True
                    m = self.lookup(params)
                    if m is not None:
                        together.append((v, m.value(self.metric)))
            out[name] = {
                "level": level.name,
                "alone": alone,
                "with_others": together,
                "contention_point": _knee(together, self.tolerance),
                "alone_point": _knee(alone, self.tolerance),
                "drop_at_max": _drop(together),
            }
        return out

    def interactions(self) -> list[dict[str, Any]]:
        """For each pair at their alone-best levels: each one's gain over the
        baseline alone, their gain together, and the interaction
        (together / (gain A x gain B) - 1: below 0, turning one on takes from the other)."""
        base, best_alone, out = self.baseline, self.alone_best(), []
        if base is None or base.value(self.metric) <= 0:
            return out
        b = base.value(self.metric)
        for first, second in combinations(self.space.optimizations, 2):
            if first not in best_alone or second not in best_alone:
                continue
            free = {"scheduler.policy": "free"}
            one = self.lookup(self.space.setting(free, **{first: best_alone[first]}))
            two = self.lookup(self.space.setting(free, **{second: best_alone[second]}))
            both = self.lookup(
                self.space.setting(free, **{first: best_alone[first], second: best_alone[second]})
            )
            if one is None or two is None or both is None:
                continue
            g1, g2, g12 = (
                one.value(self.metric) / b,
                two.value(self.metric) / b,
                both.value(self.metric) / b,
            )
            out.append(
                {
                    "a": first,
                    "b": second,
                    "gain_a": g1,
                    "gain_b": g2,
                    "gain_together": g12,
                    "interaction": g12 / (g1 * g2) - 1,
                }
            )
        return out

    def importances(self) -> dict[str, float]:
        """Optuna's importance evaluator (PED-ANOVA by default) on the metric (negated:
        the evaluator ranks what makes its target low)."""
        value = {m.number: m.value(self.metric) for m in self.measured}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "achieve low target": negated
                return optuna.importance.get_param_importances(
                    self.study, target=lambda t: -value[t.number]
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
            m = self.lookup({**best.params, "scheduler.policy": choice})
            if m is not None:
                out[choice] = m.value(self.metric)
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


def _numeric(curve: list[tuple[Any, float]]) -> list[tuple[float, float]]:
    return [
        (float(v), y) for v, y in curve if isinstance(v, (int, float)) and not isinstance(v, bool)
    ]


def _median(same: list[Measurement]) -> Measurement:
    """The median of measurements sorted by the metric (the lower one of an even
    count: a setting does not gain from being measured twice)."""
    return same[(len(same) - 1) // 2]


def _knee(curve: list[tuple[Any, float]], tolerance: float = FLAT) -> Any:
    """The lowest level whose metric is within ``tolerance`` of the curve's peak."""
    if not curve:
        return None
    peak = max(y for _, y in curve)
    ordered = sorted(curve, key=lambda p: _order(p[0]))
    return next(v for v, y in ordered if y >= (1 - tolerance) * peak)


def _order(value: Any) -> Any:
    return (
        (0, value)
        if isinstance(value, (int, float)) and not isinstance(value, bool)
        else (1, str(value))
    )


def _drop(curve: list[tuple[Any, float]]) -> float | None:
    """How far the metric at the highest level is below the peak (0.1 = 10 % lower)."""
    points = _numeric(curve)
    if not points:
        return None
    peak = max(y for _, y in points)
    last = max(points)[1]
    return 1 - last / peak if peak > 0 else None


def _describe(params: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()
    )
