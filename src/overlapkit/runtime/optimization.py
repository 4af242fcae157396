"""The contract every overlap optimization follows, and the registry that finds them.

An optimization is a small class: it declares its knobs (the tuner's search
space comes from exactly these declarations), the resources its background
work uses, what it must run after or before, and hooks named after events
(``on_step_end`` for ``Event.STEP_END``). It may wrap the model, optimizer or
loader, and owns any state it needs to resume exactly.
"""

from __future__ import annotations

import difflib
import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from .state import State


class Resource(str, Enum):
    """What an optimization's background work competes for."""

    COMPUTE = "compute"
    H2D = "h2d"
    D2H = "d2h"
    NETWORK = "network"
    DISK = "disk"
    HOST_CPU = "host_cpu"


# What the step holds while it waits on a gradient all-reduce: the link, and the
# host CPU that gloo's communication threads run on.
COMM_WAIT = (Resource.NETWORK, Resource.HOST_CPU)


@dataclass(frozen=True)
class Demand:
    """Work of an optimization that runs beside the step on the rank's host cores,
    as it declares it: ``threads`` threads or processes of ``consumer`` ("loader",
    "feeder", "persist"). Its cost is measured, not declared: the threads join
    the policy (`ArbitrationPolicy.join`, or a worker gate), which reads their CPU
    time."""

    consumer: str
    threads: int
    owner: str = ""


class WrapStage(IntEnum):
    """The fixed order in which wrappers are applied: split the model, then
    wrap it for data parallelism, then everything else."""

    SPLIT = 0
    DATA_PARALLEL = 1
    OTHER = 2


class KnobError(ValueError):
    """A knob value is unknown, of the wrong type or out of range."""

    def __init__(self, knob: str, message: str, allowed: list[str] | None = None):
        super().__init__(message)
        self.knob = knob
        self.allowed = allowed or []


class CombinationError(ValueError):
    """A set of optimizations cannot run together, or not on this set-up."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What is known of a run before it starts, for `Optimization.check_plan`.

    ``optimizations`` are all the run's optimizations by name (to check a
    combination, never to call into another one); ``batch_size`` and
    ``build_model`` are None where the caller does not know them yet.
    """

    world_size: int
    device: str
    backend: str
    optimizations: Mapping[str, Optimization] = field(default_factory=dict)
    data_parallel_size: int = 1  # ranks holding each part of the model (all, unless split)
    batch_size: int | None = None
    build_model: Callable[[], Any] | None = None
    precision: str = "fp32"  # fp32, bf16 or fp16
    accumulate: int = 1  # micro-batches per optimizer step (train.accumulate)
    framework: str = "torch"  # torch or tensorflow

    def provided(self, role: str) -> bool:
        return any(role in opt.provides for opt in self.optimizations.values())


@dataclass(frozen=True, kw_only=True)
class Knob:
    """One tunable setting of an optimization.

    ``intensity`` lists the knob's values at evenly spaced intensities from
    just above 0 to 1 (two anchors: the ends). Numbers are interpolated
    between anchors (geometrically when ``log``); other values take the
    nearest anchor. A knob without anchors keeps its default at every
    intensity.
    """

    name: str
    type: type  # float, int, bool or str
    default: Any
    low: float | None = None
    high: float | None = None
    choices: tuple[Any, ...] | None = None
    log: bool = False
    intensity: tuple[Any, ...] | None = None
    at_zero: Any = None  # the value at intensity exactly 0, when that is a mode of its own
    # What must hold for this knob to mean anything: a bool knob that must be true
    # ("auto"), or a knob that must have one value ("mode=overlap").
    needs: str | None = None
    help: str = ""
    frameworks: tuple[str, ...] | None = None  # where it means something (None: everywhere)

    def means_something(self, settings: Mapping[str, Any]) -> bool:
        """Whether ``settings`` give this knob a meaning (see ``needs``)."""
        if self.needs is None:
            return True
        name, is_value, value = self.needs.partition("=")
        return str(settings[name]) == value if is_value else bool(settings[name])

    def needs_said(self) -> str:
        name, is_value, value = (self.needs or "").partition("=")
        return f"{name} is {value}" if is_value else f"{name} is on"

    def runs_on(self, framework: str) -> bool:
        return self.frameworks is None or framework in self.frameworks

    def elsewhere(self, owner: str, framework: str) -> str:
        """Why this knob cannot be set on ``framework`` (where it does not run)."""
        return (
            f"{owner}.{self.name} is a knob of {' and '.join(self.frameworks or ())} only; "
            f"this scenario runs on {framework}"
        )

    def coerce(self, value: Any) -> Any:
        """Return ``value`` as this knob's type, or raise `KnobError`."""
        if self.type is bool:
            if not isinstance(value, bool):
                raise KnobError(self.name, f"{self.name} must be true or false, got {value!r}")
            return value
        if self.type in (int, float):
            if isinstance(value, str):
                value = number_in(value)  # YAML 1.1 reads 3e-2 (no dot) as a string
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise KnobError(
                    self.name, f"{self.name} must be a number, got {type(value).__name__} {value!r}"
                )
            if self.type is int and not float(value).is_integer():
                raise KnobError(self.name, f"{self.name} must be a whole number, got {value!r}")
            value = self.type(value)
            if (self.low is not None and value < self.low) or (
                self.high is not None and value > self.high
            ):
                raise KnobError(
                    self.name,
                    f"{self.name}={value} is out of range: allowed {self.low} to {self.high}",
                )
            return value
        if self.type is str and not isinstance(value, str):
            raise KnobError(self.name, f"{self.name} must be a string, got {value!r}")
        if self.choices is not None and value not in self.choices:
            allowed = [str(c) for c in self.choices]
            raise KnobError(
                self.name, f"{self.name}={value!r} is not allowed: choose one of {allowed}", allowed
            )
        return value

    def at_intensity(self, intensity: float) -> Any:
        if intensity == 0 and self.at_zero is not None:
            return self.at_zero
        if not self.intensity:
            return self.default
        anchors = self.intensity
        if len(anchors) == 1:
            return anchors[0]
        position = min(max(intensity, 0.0), 1.0) * (len(anchors) - 1)
        numeric = self.type in (int, float)
        if not numeric:
            return anchors[round(position)]
        i = min(int(position), len(anchors) - 2)
        frac = position - i
        lo, hi = float(anchors[i]), float(anchors[i + 1])
        if self.log:
            value = math.exp(math.log(lo) + frac * (math.log(hi) - math.log(lo)))
        else:
            value = lo + frac * (hi - lo)
        return round(value) if self.type is int else float(f"{value:.4g}")

    def describe(self) -> dict[str, Any]:
        """A plain description for `overlapkit list` and the tuner."""
        out: dict[str, Any] = {
            "name": self.name,
            "type": self.type.__name__,
            "default": self.default,
        }
        if self.choices is not None:
            out["choices"] = list(self.choices)
        if self.low is not None or self.high is not None:
            out["range"] = [self.low, self.high]
        if self.log:
            out["log"] = True
        if self.intensity:
            out["intensity"] = list(self.intensity)
        if self.at_zero is not None:
            out["at_zero"] = self.at_zero
        if self.help:
            out["help"] = self.help
        if self.frameworks is not None:
            out["frameworks"] = list(self.frameworks)
        return out


class Optimization:
    """Base class of the overlap optimizations.

    Subclasses set the class attributes below and define hooks named after
    events (see `overlapkit.runtime.events.Event.hook_name`), each taking the
    loop's `State`. ``intensity`` in [0, 1] sets every knob that declares
    intensity anchors; knobs given explicitly override that mapping.
    """

    name: ClassVar[str] = ""
    knobs: ClassVar[tuple[Knob, ...]] = ()
    resources: ClassVar[frozenset[Resource]] = frozenset()
    provides: ClassVar[frozenset[str]] = frozenset()  # roles only one optimization may fill
    after: ClassVar[tuple[str, ...]] = ()
    before: ClassVar[tuple[str, ...]] = ()
    conflicts: ClassVar[tuple[str, ...]] = ()
    wrap_stage: ClassVar[WrapStage] = WrapStage.OTHER
    min_world_size: ClassVar[int] = 1
    off_at_zero: ClassVar[bool] = True
    # Frameworks beyond torch it runs on: each one's engine, a module beside the class
    # (see `engine_for`); and why it does not run on others, where that is known.
    engines: ClassVar[Mapping[str, str]] = {}
    unavailable: ClassVar[Mapping[str, str]] = {}
    # What `overlapkit compare` shows of its summary section: label -> dotted path
    # (the first path that the section has, for figures that differ by framework).
    key_figures: ClassVar[Mapping[str, tuple[str, ...]]] = {}

    def __init__(self, intensity: float = 1.0, **explicit: Any) -> None:
        self.intensity = float(intensity)
        self.explicit = dict(explicit)
        self.settings = self.resolve(intensity, explicit)

    @classmethod
    def resolve(cls, intensity: float, explicit: dict[str, Any]) -> dict[str, Any]:
        """Knob values for ``intensity``, with ``explicit`` values on top; validates both."""
        if isinstance(intensity, bool) or not isinstance(intensity, (int, float)):
            raise KnobError("intensity", f"intensity must be a number in [0, 1], got {intensity!r}")
        if not 0.0 <= intensity <= 1.0:
            raise KnobError("intensity", f"intensity={intensity} is out of range: allowed 0 to 1")
        by_name = {k.name: k for k in cls.knobs}
        unknown = [key for key in explicit if key not in by_name]
        if unknown:
            allowed = ["intensity", *by_name]
            hint = difflib.get_close_matches(unknown[0], allowed, n=1)
            message = f"{cls.name} has no knob {unknown[0]!r}"
            message += f" (did you mean {hint[0]!r}?)" if hint else ""
            raise KnobError(unknown[0], message + f"; allowed: {', '.join(allowed)}", allowed)
        settings = {k.name: k.at_intensity(intensity) for k in cls.knobs}
        settings.update({key: by_name[key].coerce(value) for key, value in explicit.items()})
        for knob in cls.knobs:
            changed = settings[knob.name] != knob.default  # its default: harmless
            if knob.name in explicit and changed and not knob.means_something(settings):
                raise KnobError(
                    knob.name,
                    f"{knob.name} means something only when {knob.needs_said()}: set that, "
                    f"or leave {knob.name} out",
                )
        return settings

    @classmethod
    def frameworks(cls) -> tuple[str, ...]:
        return ("torch", *cls.engines)

    @classmethod
    def why_not_on(cls, framework: str) -> str | None:
        """Why it does not run on ``framework`` (None: it does)."""
        if framework in cls.frameworks():
            return None
        return cls.unavailable.get(framework, f"it runs on {' and '.join(cls.frameworks())}")

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {
            "name": cls.name,
            "doc": (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else "",
            "frameworks": list(cls.frameworks()),
            "resources": sorted(r.value for r in cls.resources),
            "knobs": [k.describe() for k in cls.knobs],
        }

    # Checks and wrappers: override what applies.
    def check(self, world_size: int, device: str, backend: str) -> None:
        """Raise `CombinationError` when this set-up (ranks, device type ``cpu``/``cuda``,
        back end ``gloo``/``nccl``) cannot run the optimization."""
        if world_size < self.min_world_size:
            raise CombinationError(
                f"{self.name} needs at least {self.min_world_size} ranks, the run has {world_size}"
            )

    def check_plan(self, plan: Plan) -> None:
        """Raise `CombinationError` for what only the whole plan shows: the other
        optimizations, the batch size, the model. Runs after `check`."""

    def check_run_folder(self, run_dir: Path, world_size: int) -> None:
        """Raise for what the run folder shows before any rank starts (what is left
        there by an earlier run); a user's mistake found here is one clear line, not
        a rank's traceback."""

    def resumes_at(self, run_dir: Path) -> int | None:
        """The step a run in ``run_dir`` would resume at from what an earlier run saved
        there (None: it would start at step 0)."""
        return None

    def saved_setup(self, run_dir: Path) -> dict[str, Any] | None:
        """The setup recorded beside what an earlier run saved for ``run_dir`` (see
        `State.setup`; None: nothing recorded)."""
        return None

    def saved_layout(self) -> dict[str, Any]:
        """How the checkpoints of a run with this optimization are laid out, beyond its
        model, data and optimizer (a pipeline's stages and split): a run that resumes
        them under another layout, or without the optimization, cannot load them."""
        return {}

    def environment(self, backend: str) -> dict[str, str]:
        """Environment variables this optimization needs set before the process group
        starts (a communication library reads some only then), for ``backend``."""
        return {}

    def data_shard(self, rank: int, world_size: int) -> tuple[int, int] | None:
        """For an optimization that splits the model across ranks: which data shard
        ``rank`` reads and how many shards there are. None: one shard per rank."""
        return None

    def wrap_model(self, model: Any, state: State) -> Any:
        return model

    def wrap_optimizer(self, optimizer: Any, state: State) -> Any:
        return optimizer

    def wrap_loader(self, loader: Any, state: State) -> Any:
        return loader

    def cpu_demands(self, state: State) -> list[Demand]:
        """What this optimization runs beside the step on the host's cores, once
        its wrappers are applied (the ``partition`` policy divides the cores by it)."""
        return []

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def summary(self) -> dict[str, Any]:
        """This optimization's section of ``summary.json``."""
        return {"intensity": self.intensity, **self.settings}


FRAMEWORKS = ("torch", "tensorflow")


def check_framework(optimization: Optimization, framework: str) -> None:
    """Raise `CombinationError` when ``optimization`` has no engine on ``framework``."""
    reason = optimization.why_not_on(framework)
    if reason is not None:
        raise CombinationError(f"{optimization.name} does not run on {framework}: {reason}")
    for knob in optimization.knobs:
        if knob.name in optimization.explicit and not knob.runs_on(framework):
            raise CombinationError(knob.elsewhere(optimization.name, framework))


def settings_on(optimization: Optimization, framework: str) -> dict[str, Any]:
    """Its intensity and the settings of the knobs that mean something on ``framework``."""
    return {
        "intensity": optimization.intensity,
        **{
            k.name: optimization.settings[k.name]
            for k in optimization.knobs
            if k.runs_on(framework)
        },
    }


def engine_for(optimization: Optimization, framework: str) -> Any:
    """``optimization``'s engine on ``framework`` (torch: the optimization itself, whose
    hooks the session fires): what the module its ``engines`` names builds from it."""
    if framework == "torch":
        return optimization
    check_framework(optimization, framework)
    module = importlib.import_module(optimization.engines[framework])
    return module.engine(optimization)


REGISTRY: dict[str, type[Optimization]] = {}


def register_optimization(cls: type[Optimization]) -> type[Optimization]:
    """Class decorator: make ``cls`` available to scenarios under ``cls.name``."""
    if not cls.name:
        raise TypeError(f"{cls.__qualname__} must set a name")
    for knob in cls.knobs:  # a plugin's declaration, checked once, not in every run
        try:
            if knob.default is not None:
                knob.coerce(knob.default)
        except KnobError as error:
            raise TypeError(f"{_origin(cls)}: the default of knob {knob.name}: {error}") from None
    taken = REGISTRY.get(cls.name)
    if taken is not None and _origin(taken) != _origin(cls):
        raise TypeError(
            f"{_origin(cls)} takes the name {cls.name!r} of {_origin(taken)}: give it a "
            "name of its own"
        )
    REGISTRY[cls.name] = cls
    return cls


def number_in(text: str) -> Any:
    """The finite number ``text`` spells, else ``text`` as it is."""
    try:
        number = float(text)
    except ValueError:
        return text
    return number if math.isfinite(number) else text


def _origin(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def optimization_class(name: str) -> type[Optimization]:
    """A registered optimization's class (`Session.save` uses the checkpoint's format).
    Built-ins register when their package loads: it is loaded by name, so that the
    runtime never imports the optimizations."""
    if name not in REGISTRY:
        importlib.import_module("overlapkit.optimizations").registered_optimizations()
    return REGISTRY[name]


def needed_environment(optimizations: Sequence[Optimization], backend: str) -> dict[str, str]:
    """What the optimizations need in the environment before the process group starts."""
    return {k: v for opt in optimizations for k, v in opt.environment(backend).items()}
