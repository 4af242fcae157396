"""The search space, declared by the optimizations themselves.

Each searched optimization contributes its ``intensity`` (0 = off) or, when the
scenario's ``tune.search`` names raw knobs instead, those knobs plus an
``on`` switch; the scheduler contributes its policy. A parameter is named
``<optimization>.<knob>`` (``scheduler.policy``), the name Optuna, the report
and optuna-dashboard show.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from typing import Any

from ..optimizations import get_optimization
from ..runtime import POLICIES, CombinationError, KnobError
from ..runtime.optimization import Plan
from .config import TuneConfig

SWEEP_POINTS = 5  # values of a wide numeric knob that a grid or a curve visits
SCHEDULER = "scheduler"  # the owner of the policy and of its knobs' dimensions


class SpaceError(ValueError):
    """``tune.search`` names something that cannot be searched."""

    def __init__(self, path: str, message: str, allowed: list[str] | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.allowed = allowed or []


@dataclass(frozen=True)
class Dimension:
    owner: str  # an optimization's name, or "scheduler"
    knob: str  # "intensity", "on", "policy" or a raw knob
    kind: str  # "float", "int" or "categorical"
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    choices: tuple[Any, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.owner}.{self.knob}"

    def suggest(self, trial: Any) -> Any:
        if self.kind == "categorical":
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high), log=self.log)
        return trial.suggest_float(self.name, self.low, self.high, step=self.step, log=self.log)

    def values(self) -> list[Any]:
        """The values a grid (or a contention curve) visits, in order."""
        if self.kind == "categorical":
            return list(self.choices)
        low, high = float(self.low), float(self.high)
        if self.step:
            count = int(round((high - low) / self.step))
            return [round(low + i * self.step, 10) for i in range(count + 1)]
        if self.kind == "int" and high - low < 2 * SWEEP_POINTS:
            return list(range(int(low), int(high) + 1))
        if self.log:
            points = [math.exp(v) for v in _linspace(math.log(low), math.log(high))]
        else:
            points = _linspace(low, high)
        if self.kind == "int":
            return sorted({int(round(p)) for p in points})
        return [float(f"{p:.4g}") for p in points]

    @property
    def off_value(self) -> Any:
        """The value that turns the owner off (None: it has none)."""
        return {"intensity": 0.0, "on": False}.get(self.knob)


def _linspace(low: float, high: float) -> list[float]:
    return [low + (high - low) * i / (SWEEP_POINTS - 1) for i in range(SWEEP_POINTS)]


@dataclass(frozen=True)
class SearchSpace:
    dimensions: tuple[Dimension, ...]

    @property
    def optimizations(self) -> list[str]:
        return list(dict.fromkeys(d.owner for d in self.dimensions if d.owner != "scheduler"))

    def level(self, optimization: str) -> Dimension:
        """The dimension that sets how hard ``optimization`` overlaps: its intensity,
        else its first raw knob (the axis of its contention curve)."""
        own = [d for d in self.dimensions if d.owner == optimization]
        return next(
            (d for d in own if d.knob == "intensity"), next(d for d in own if d.knob != "on")
        )

    def suggest(self, trial: Any) -> dict[str, Any]:
        return {d.name: d.suggest(trial) for d in self.dimensions}

    def grid(self) -> dict[str, list[Any]]:
        return {d.name: d.values() for d in self.dimensions}

    def grid_size(self) -> int:
        return math.prod(len(v) for v in self.grid().values())

    def grid_points(self) -> list[dict[str, Any]]:
        grid = self.grid()
        return [
            dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())
        ]

    def is_on(self, params: dict[str, Any], optimization: str) -> bool:
        for d in self.dimensions:
            if d.owner == optimization and d.off_value is not None:
                return params[d.name] != d.off_value
        return True

    def setting(self, base: dict[str, Any], **levels: Any) -> dict[str, Any]:
        """A full parameter set: every optimization off (``level=None``) unless given in
        ``levels`` (optimization -> its level value, or "max"), others from ``base``."""
        params = {}
        for d in self.dimensions:
            if d.owner == SCHEDULER:
                params[d.name] = base.get(d.name, d.values()[0])
            elif d.off_value is not None and d.owner not in levels:
                params[d.name] = d.off_value
            elif d.knob == "on":
                params[d.name] = True
            elif d is self.level(d.owner) and d.owner in levels:
                value = levels[d.owner]
                params[d.name] = d.values()[-1] if value == "max" else value
            else:
                params[d.name] = base.get(d.name, d.values()[-1])
        return params


def build_space(
    optimizations: dict[str, Any], tune: TuneConfig, framework: str = "torch"
) -> SearchSpace:
    """The space for a scenario's ``optimizations`` section and its ``tune`` section, on
    ``framework``: an optimization or knob that does not run there cannot be searched,
    and the scheduler's policy is searched only where its choices differ (on
    TensorFlow, nothing inside the compiled step says when it waits on communication:
    ``priority`` runs as ``free``)."""
    search = tune.search if tune.search is not None else {name: None for name in optimizations}
    if checkpoint_by_model(optimizations, tune):
        search = {name: knobs for name, knobs in search.items() if name != MODELLED}
        if not any(name != SCHEDULER for name in search):
            raise SpaceError(
                "tune.search",
                "nothing to search: with goodput in the objective the checkpoint's interval "
                "comes from the model (tune.checkpoint_interval: model) and nothing else is "
                "searched; add an optimization, or set tune.checkpoint_interval: search",
            )
    dims: list[Dimension] = []
    policy_knobs = search.get(SCHEDULER)
    for name, knobs in search.items():
        if name == SCHEDULER:
            continue
        try:
            cls = get_optimization(name)
        except KnobError as error:
            raise SpaceError(f"tune.search.{name}", str(error), error.allowed) from None
        if (reason := cls.why_not_on(framework)) is not None:
            raise SpaceError(
                f"tune.search.{name}", f"{name} cannot be searched on {framework}: {reason}"
            )
        if knobs is None:
            knobs = ["intensity"]
        if isinstance(knobs, list):
            knobs = {k: None for k in knobs}
        if not knobs:
            raise SpaceError(f"tune.search.{name}", f"tune.search.{name} names no knob to search")
        if "intensity" not in knobs:
            dims.append(Dimension(name, "on", "categorical", choices=(True, False)))
        own = [
            _dimension(cls, knob, given, tune.intensity_step, framework)
            for knob, given in knobs.items()
        ]
        _check_together(cls, optimizations.get(name) or {}, own)
        dims += own
    if tune.policy and framework == "torch":
        dims.append(Dimension(SCHEDULER, "policy", "categorical", choices=tuple(POLICIES)))
    if policy_knobs is not None:
        dims += _policy_dimensions(policy_knobs, framework, tune.intensity_step)
    if not any(d.owner != "scheduler" for d in dims):
        said = (
            "the scenario lists no optimizations"
            if tune.search is None
            else "tune.search names no optimization (leave it out to search every listed one)"
        )
        raise SpaceError("tune.search", f"nothing to search: {said}")
    return SearchSpace(tuple(dims))


MODELLED = "checkpoint"  # the optimization whose level a model sets (see `checkpoint_model`)


def checkpoint_by_model(optimizations: dict[str, Any], tune: TuneConfig) -> bool:
    """Whether the checkpoint's interval comes from the goodput model, not the search:
    goodput is (one of) the objective(s), the search would include the checkpoint, and
    ``tune.checkpoint_interval`` is ``model``."""
    searched = tune.search if tune.search is not None else optimizations
    return (
        tune.checkpoint_interval == "model"
        and tune.objective in ("goodput", "both")
        and MODELLED in searched
    )


def runnable_search(
    search: dict[str, Any] | None,
    optimizations: dict[str, Any],
    setup: tuple[int, str, str],
    framework: str = "torch",
) -> tuple[dict[str, Any] | None, list[str]]:
    """``tune.search`` with each knob searched over its declared choices narrowed to
    those the set-up (ranks, device type, back end) and ``framework`` run, e.g. no
    bf16 comm_hook on gloo, no torch prefetch back end on TensorFlow: a trial of
    another would only be refused. The tuner records the narrowed
    lists, so the study's report rebuilds the same space on any machine. Returns the
    search and a note per knob narrowed."""
    if search is None:
        return None, []
    ranks, device, backend = setup
    plan = Plan(world_size=ranks, device=device, backend=backend, framework=framework)
    narrowed: dict[str, Any] = {}
    notes = []
    for name, knobs in search.items():
        narrowed[name] = knobs
        if name == SCHEDULER or not isinstance(knobs, (dict, list)):
            continue
        try:
            cls = get_optimization(name)
        except KnobError:
            continue  # build_space names the mistake
        knobs = {k: None for k in knobs} if isinstance(knobs, list) else dict(knobs)
        own = {k: v for k, v in (optimizations.get(name) or {}).items() if k != "intensity"}
        for knob in cls.knobs:
            if knob.choices is None or knob.name not in knobs or knobs[knob.name] is not None:
                continue
            runs, refused = [], {}
            for choice in knob.choices:
                try:
                    trial = cls(1.0, **{**own, knob.name: choice})
                    trial.check(*setup)
                    trial.check_plan(plan)
                    runs.append(choice)
                except (CombinationError, KnobError) as error:
                    refused[choice] = str(error)
            if runs and refused:
                knobs[knob.name] = runs
                notes.append(
                    f"{name}.{knob.name} searches {', '.join(map(str, runs))}; left out "
                    + "; ".join(f"{choice} ({why})" for choice, why in refused.items())
                )
        narrowed[name] = knobs
    return narrowed, notes


def _without_idle_knobs(cls: type, entry: dict[str, Any]) -> dict[str, Any]:
    """``entry`` without the knobs whose ``needs`` the trial's setting turned off (the
    scenario's max_overhead where the intensity searched replaces its every: auto; a
    searched comm_hook at intensity 0, where ddp_overlap is its no_overlap baseline)."""
    needing = {k.name: k for k in cls.knobs if k.needs and k.name in entry}
    if not needing:
        return entry
    rest = {k: v for k, v in entry.items() if k not in needing}
    settings = cls.resolve(rest.pop("intensity", 1.0), rest)
    return {
        k: v for k, v in entry.items() if k not in needing or needing[k].means_something(settings)
    }


SETTINGS_CHECKED = 64  # searched combinations of one optimization's raw knobs tried at check


def _check_together(cls: type, base: dict[str, Any], dims: list[Dimension]) -> None:
    """The searched knobs with the scenario's own: a knob that the others leave idle
    (checkpoint.max_overhead with auto off) is refused here, not in every trial."""
    raw = [d for d in dims if d.knob not in ("intensity", "on")]
    if not raw:
        return
    settings = {k: v for k, v in base.items() if k != "intensity"}
    combinations = itertools.product(*(d.values() for d in raw))
    for values in itertools.islice(combinations, SETTINGS_CHECKED):
        searched = {d.knob: value for d, value in zip(raw, values, strict=True)}
        try:
            cls.resolve(1.0, {**settings, **searched})
        except KnobError as error:
            path = f"tune.search.{cls.name}.{error.knob}"
            raise SpaceError(path, str(error), error.allowed) from None


def _policy_dimensions(knobs: Any, framework: str, step: float) -> list[Dimension]:
    """``tune.search.scheduler``: the partition policy's own knobs (they take effect in
    the trials that run under it)."""
    cls = POLICIES["partition"]
    if framework not in cls.frameworks:
        named = knobs if isinstance(knobs, (list, dict)) else []
        raise SpaceError(
            "tune.search.scheduler",
            f"on {framework} the scheduler's policy is not searched (nothing inside a compiled "
            "step says when it waits on communication: priority runs as free, partition not "
            "at all); set scheduler.policy in the scenario and leave tune.search.scheduler out"
            if "policy" in named
            else f"tune.search.scheduler searches the partition policy's knobs, and the "
            f"partition policy does not run on {framework}: leave tune.search.scheduler out",
        )
    if isinstance(knobs, list):
        knobs = {k: None for k in knobs}
    if not knobs:
        allowed = [k.name for k in cls.knobs]
        raise SpaceError(
            "tune.search.scheduler", "tune.search.scheduler names no knob to search", allowed
        )
    dims = []
    for knob, given in knobs.items():
        if knob in ("policy", "intensity"):
            raise SpaceError(
                f"tune.search.scheduler.{knob}",
                "the policy is searched by tune.policy: true; name the partition policy's "
                f"knobs here ({', '.join(k.name for k in cls.knobs)})",
                [k.name for k in cls.knobs],
            )
        dims.append(_dimension(cls, knob, given, step, framework, owner=SCHEDULER))
    return dims


def _dimension(
    cls: type, knob_name: str, given: Any, step: float, framework: str, owner: str | None = None
) -> Dimension:
    owner = owner or cls.name
    path = f"tune.search.{owner}.{knob_name}"
    if knob_name == "intensity":
        if given is not None:
            raise SpaceError(path, "intensity is searched over 0..1 in tune.intensity_step steps")
        return Dimension(owner, "intensity", "float", 0.0, 1.0, step=step)
    by_name = {k.name: k for k in cls.knobs}
    if knob_name not in by_name:
        allowed = ["intensity", *by_name]
        raise SpaceError(path, f"{cls.name} has no knob {knob_name!r}", allowed)
    knob = by_name[knob_name]
    if not knob.runs_on(framework):
        allowed = [k.name for k in cls.knobs if k.runs_on(framework)]
        raise SpaceError(path, knob.elsewhere(cls.name, framework), allowed)
    try:
        if isinstance(given, list):
            if not given:
                raise SpaceError(path, f"the list of {knob_name} values to search is empty")
            values = tuple(dict.fromkeys(knob.coerce(v) for v in given))
            return Dimension(owner, knob_name, "categorical", choices=values)
        if isinstance(given, dict):
            if knob.type not in (int, float):
                raise SpaceError(path, f"{knob_name} is not a number: give a list of values")
            unknown = set(given) - {"low", "high", "log"}
            if unknown or not {"low", "high"} <= set(given):
                raise SpaceError(path, "a range is {low: .., high: .., log: true|false}")
            low, high = knob.coerce(given["low"]), knob.coerce(given["high"])
            return _numeric(owner, knob, low, high, bool(given.get("log", knob.log)), path)
    except KnobError as error:
        raise SpaceError(path, str(error), error.allowed) from None
    if given is not None:
        raise SpaceError(path, "give a list of values or a {low, high} range")
    if knob.type is bool:
        return Dimension(owner, knob_name, "categorical", choices=(False, True))
    if knob.choices is not None:
        return Dimension(owner, knob_name, "categorical", choices=tuple(knob.choices))
    if knob.type in (int, float) and knob.low is not None and knob.high is not None:
        return _numeric(owner, knob, knob.low, knob.high, knob.log, path)
    raise SpaceError(
        path,
        f"{cls.name}.{knob_name} declares no range or choices: give them, e.g. "
        f"{{{knob_name}: [a, b, c]}} or {{{knob_name}: {{low: a, high: b}}}}",
    )


def _numeric(owner: str, knob: Any, low: float, high: float, log: bool, path: str) -> Dimension:
    if low == high:
        raise SpaceError(
            path,
            f"the range of {knob.name} holds one value ({low}): search two or more, or set "
            f"{knob.name}: {low} among the optimization's knobs instead",
        )
    if low > high:
        raise SpaceError(path, f"the range of {knob.name} is empty: {low} to {high}")
    if log and low <= 0:
        raise SpaceError(path, f"a log range of {knob.name} must start above 0")
    kind = "int" if knob.type is int else "float"
    return Dimension(owner, knob.name, kind, low, high, log=log)


def apply_params(
    base: dict[str, Any], space: SearchSpace, params: dict[str, Any]
) -> dict[str, Any]:
    """The scenario data of one trial: ``base`` (a scenario as plain data) with ``params``.

    Where the intensity is searched, the base's values of the knobs it maps are
    dropped, so that the intensity takes effect; its other knobs (a checkpoint's
    folder, a pipeline's stages) stay."""
    data = copy.deepcopy(base)
    optimizations = dict(data.get("optimizations") or {})
    for name in space.optimizations:
        cls = get_optimization(name)
        intensity = params.get(f"{name}.intensity")
        if params.get(f"{name}.on") is False or (intensity == 0 and cls.off_at_zero):
            optimizations.pop(name, None)
            continue
        entry = dict(optimizations.get(name) or {})
        if intensity is not None:
            mapped = {k.name for k in cls.knobs if k.intensity or k.at_zero is not None}
            entry = {k: v for k, v in entry.items() if k not in mapped}
        for d in space.dimensions:
            if d.owner == name and d.knob != "on":
                entry[d.knob] = params[d.name]
        optimizations[name] = _without_idle_knobs(cls, entry)
    data["optimizations"] = optimizations
    scheduler = dict(data.get("scheduler") or {})
    for d in space.dimensions:
        if d.owner != SCHEDULER:
            continue
        if d.knob == "policy":
            scheduler["policy"] = params[d.name]
        else:  # a knob of the partition policy
            scheduler["partition"] = {**(scheduler.get("partition") or {}), d.knob: params[d.name]}
    if scheduler:
        data["scheduler"] = scheduler
    return data


def short_setting(params: dict[str, Any]) -> str:
    """E.g. "ddp_overlap 1, prefetch 0, checkpoint every 8, free"."""
    parts = []
    for name, value in params.items():
        owner, knob = name.split(".")
        if owner == SCHEDULER and knob == "policy":
            parts.append(str(value))
        elif owner == SCHEDULER:
            if params.get("scheduler.policy", "partition") == "partition":
                parts.append(f"{knob} {value}")
        elif knob == "on":
            if value is False:
                parts.append(f"{owner} off")
        elif params.get(f"{owner}.on", True):
            parts.append(f"{owner} {value:g}" if knob == "intensity" else f"{owner} {knob} {value}")
    return ", ".join(parts)
