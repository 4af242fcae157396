"""A scenario: one typed object built from one YAML file.

Each section is the config of the component that owns it; the scenario only
puts them together and checks that they fit each other.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..backends.tensorflow import check_gpu_setup as check_tf_gpu_setup
from ..backends.tensorflow import tensorflow_missing
from ..config import Config
from ..data import DataConfig, ResumableLoader, build_loaders
from ..launch.config import WorldConfig
from ..models import ModelConfig
from ..optimizations import get_optimization, registered_optimizations
from ..runtime import CombinationError, KnobError, Optimization, Scheduler, SchedulerConfig
from ..runtime.distributed import resolve_backend, resolve_device
from ..runtime.gpus import check_cpu_setup, check_gpu_setup
from ..runtime.loop import TrainConfig
from ..runtime.optimization import engine_for
from ..runtime.tensorboard import LogConfig, tensorboard_missing
from ..tuning import TuneConfig
from ..tuning.space import SpaceError, build_space


def located(path: str, message: str, allowed: list[str] | None = None) -> PydanticCustomError:
    """A validation error that remembers which YAML path it is about."""
    return PydanticCustomError(
        "scenario", "{message}", {"message": message, "path": path, "allowed": allowed or []}
    )


def check_cpu_ranks(local_ranks: int) -> None:
    """CPU ranks on this machine: at most one per core it may use (its affinity). More
    would time-slice, and every overlap figure would measure the OS scheduler."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cores and local_ranks > cores:
        raise CombinationError(
            f"world.nprocs: {local_ranks} CPU ranks on this machine, but it has {cores} "
            f"cores (its CPU affinity): each rank needs a core of its own; at most {cores}"
        )


def build_optimizations(section: dict[str, dict[str, Any] | None]) -> list[Optimization]:
    """The enabled optimizations of a scenario's ``optimizations`` section (intensity 0
    means off, whatever else is set, as in a tune's trials, unless it is a mode of the
    optimization's own), in the order listed."""
    built = []
    for name, settings in section.items():
        settings = dict(settings or {})
        intensity = settings.pop("intensity", 1.0)
        cls = get_optimization(name)
        if intensity == 0 and cls.off_at_zero:
            continue
        built.append(cls(intensity, **settings))
    return built


class Scenario(Config):
    name: str
    framework: Literal["torch", "tensorflow"] = "torch"
    model: ModelConfig
    data: DataConfig
    train: TrainConfig = TrainConfig()
    world: WorldConfig = WorldConfig()
    optimizations: dict[str, dict[str, Any] | None] = Field(default_factory=dict)
    scheduler: SchedulerConfig = SchedulerConfig()
    log: LogConfig = LogConfig()
    tune: TuneConfig = TuneConfig()

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", value):
            raise located(
                "name",
                f"name {value!r} names the run folders (runs/NAME-...): use letters, digits, "
                "'.', '_' and '-', starting with a letter or digit",
            )
        return value

    @field_validator("optimizations")
    @classmethod
    def _check_optimizations(cls, value: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
        for name, settings in value.items():
            try:
                optimization = get_optimization(name)
            except KnobError as error:
                raise located(f"optimizations.{name}", str(error), error.allowed) from None
            settings = dict(settings or {})
            intensity = settings.pop("intensity", 1.0)
            try:
                optimization.resolve(intensity, settings)
            except KnobError as error:
                raise located(
                    f"optimizations.{name}.{error.knob}", str(error), error.allowed
                ) from None
        return value

    @model_validator(mode="after")
    def _check_fit(self) -> Scenario:
        model, data = self.model, self.data
        if model.input_kind != data.input_kind:
            raise located(
                "model.name",
                f"model {model.name} reads {model.input_kind} but data {data.name} yields {data.input_kind}",
            )
        classes = getattr(
            data, "num_classes", None
        )  # an image folder's count is known only on disk
        if classes is not None and model.num_classes != classes:
            raise located(
                "model.num_classes",
                f"model.num_classes is {model.num_classes} but data {data.name} has {classes} classes",
            )
        shape = getattr(data, "shape", None)
        if shape is not None and min(shape) < 1:
            raise located(
                "data.shape",
                f"data.shape {list(shape)}: every side must be at least 1 ([3, H, W])",
            )
        if model.input_kind == "images" and shape is not None and shape[0] != 3:
            raise located(
                "data.shape",
                f"data.shape {list(shape)} has {shape[0]} channel(s); model {model.name} "
                "reads 3 (RGB): use [3, H, W]",
            )
        vocab = getattr(data, "vocab_size", None)
        if vocab is not None and vocab > model.vocab_size:
            raise located(
                "model.vocab_size",
                f"model.vocab_size ({model.vocab_size}) is smaller than data.vocab_size ({vocab})",
            )
        seq_len = getattr(data, "seq_len", None)
        if seq_len is not None and seq_len > model.max_len:
            raise located(
                "model.max_len",
                f"model.max_len ({model.max_len}) is below data.seq_len ({seq_len})",
            )
        wants_eval = self.train.eval.every or self.train.eval.at_end
        if wants_eval and getattr(data, "eval_samples", None) == 0:
            raise located(
                "train.eval",
                "train.eval asks for evaluation, but data.eval_samples is 0: set "
                "data.eval_samples, or turn evaluation off",
            )
        if self.world.backend == "nccl" and self.world.device == "cpu":
            raise located("world.backend", "nccl needs CUDA devices; use gloo (or auto) on CPU")
        if self.train.precision == "fp16" and self.world.device == "cpu":
            raise located("train.precision", "fp16 needs a CUDA device; use bf16 on CPU")
        if self.framework == "tensorflow":
            self._check_tensorflow()
        if self.tune.search is not None:
            try:
                build_space(self.optimizations, self.tune, self.framework)
            except SpaceError as error:
                raise located(error.path, str(error), error.allowed) from None
        return self

    def _check_tensorflow(self) -> None:
        """What the TensorFlow loop does not do (yet), refused before anything starts."""
        if self.train.accumulate > 1:
            raise located(
                "train.accumulate",
                "train.accumulate > 1 is not available with framework: tensorflow (its "
                "compiled step applies every batch); raise train.batch_size instead",
            )
        if self.world.backend != "auto":  # gloo too: it would be ignored, not used
            raise located(
                "world.backend",
                "world.backend is torch's process-group back end; with framework: tensorflow "
                "leave it auto: the collective implementation is "
                "optimizations.ddp_overlap.implementation",
            )

    def build_loaders(
        self, shard: int, shards: int, pin_memory: bool = False
    ) -> tuple[ResumableLoader, Any]:
        """Data shard ``shard`` of ``shards``: its training loader, and its evaluation
        loader when ``train.eval`` asks for evaluation (else None)."""
        cfg = self.train
        train_set, eval_set = self.data.build(cfg.seed)
        wants_eval = bool(cfg.eval.every or cfg.eval.at_end)
        return build_loaders(
            train_set,
            eval_set if wants_eval else None,
            cfg.batch_size,
            shard,
            shards,
            cfg.seed,
            cfg.eval.max_samples,
            pin_memory=pin_memory,
        )

    def build_optimizations(self) -> list[Optimization]:
        """The enabled optimizations, in the order listed (see `build_optimizations`)."""
        return build_optimizations(self.optimizations)

    def applicable_optimizations(self) -> tuple[list[str], dict[str, str]]:
        """The built-in optimizations this scenario's world and model can run, each on
        its own at full intensity; and why each other one cannot."""
        chosen, left_out = [], {}
        for name, cls in registered_optimizations().items():
            if not cls.__module__.startswith("overlapkit."):
                continue  # a plugin: the user names it
            if getattr(cls, "noop_alone", False) and self.world.ranks == 1:
                left_out[name] = "does nothing with one rank"
                continue
            try:
                self._check_plan([cls(1.0)], self.world.ranks)
            except (CombinationError, KnobError) as error:
                left_out[name] = str(error)
                continue
            # Beside those chosen before it: a trial runs them together (pipeline and
            # ddp_overlap on 2 ranks: every trial that searched both was refused).
            together = [get_optimization(n)(1.0) for n in chosen] + [cls(1.0)]
            try:
                self._check_plan(together, self.world.ranks)
            except (CombinationError, KnobError) as error:
                left_out[name] = f"cannot run beside {', '.join(chosen)} here: {error}"
            else:
                chosen.append(name)
        return chosen, left_out

    def search_problem(self) -> str | None:
        """Why ``tune.search`` cannot be tuned here: it names optimizations this set-up
        cannot run, or in which it does nothing (every trial would fail, or measure
        noise). None when it can."""
        if not self.tune.search:
            return None
        _, left_out = self.applicable_optimizations()
        said = [f"{n}: {left_out[n]}" for n in self.tune.search if n in left_out]
        said += self._idle_searched_knobs(skip=left_out)
        return (
            f"tune.search names what this set-up cannot tune ({'; '.join(said)}): leave it out"
            if said
            else None
        )

    def _idle_searched_knobs(self, skip: dict[str, str]) -> list[str]:
        """The searched knobs this framework's engine runs without effect here (every
        trial of theirs would measure noise), as ``name.knob: why``; the optimizations
        in ``skip`` (which cannot run here) aside."""
        said = []
        for name, knobs in (self.tune.search or {}).items():
            if not isinstance(knobs, (list, dict)) or name in skip:
                continue
            if name not in registered_optimizations():
                continue
            engine = engine_for(get_optimization(name)(), self.framework)
            idle = getattr(engine, "idle_knobs", lambda device: {})(self.device_type)
            said += [f"{name}.{knob}: {why}" for knob, why in idle.items() if knob in knobs]
        return said

    @property
    def backend(self) -> str:
        """The process-group back end the run will use (``auto`` resolved)."""
        return resolve_backend(self.world.backend, self.device_type)

    @property
    def device_type(self) -> str:
        return resolve_device(self.world.device)

    @property
    def setup(self) -> tuple[int, str, str]:
        """(ranks, device type, back end): what decides which knob values can run."""
        return self.world.ranks, self.device_type, self.backend

    def check_setup(self, world_size: int | None = None, gpus_here: bool = True) -> None:
        """Let every optimization check this set-up before any process starts
        (``world_size`` when something else, like torchrun, decides it), and on GPUs
        whether this machine and torch build can run it (``gpus_here``: False on a
        Ray driver, whose trials run on other machines that check their own)."""
        local = os.environ.get("LOCAL_WORLD_SIZE") if world_size else None
        local_ranks = int(local) if local else self.world.nprocs
        if self.framework == "tensorflow":
            reason = tensorflow_missing()
            if reason:
                raise CombinationError(reason)
        if self.log.tensorboard is not None and (reason := tensorboard_missing()):
            raise CombinationError(reason)
        board = self.log.tensorboard
        if board is not None and Path(board).exists() and not Path(board).is_dir():
            raise CombinationError(f"log.tensorboard {board}: is a file; name a folder")
        if self.device_type == "cuda" and gpus_here and self.framework == "torch":
            check_gpu_setup(local_ranks, self.train.precision)
        if self.device_type == "cuda" and gpus_here and self.framework == "tensorflow":
            check_tf_gpu_setup(local_ranks)
        # On a Ray driver "auto" is decided by the cluster's machines, not this one.
        if self.world.device == "cpu" or (self.device_type == "cpu" and gpus_here):
            check_cpu_setup(self.train.precision, self.backend)
        self._check_plan(self.build_optimizations(), world_size or self.world.ranks)
        if self.device_type == "cpu" and gpus_here:  # what the plan is, then whether it fits
            check_cpu_ranks(local_ranks)
        self._check_data(world_size or self.world.ranks)

    def _check_data(self, world_size: int) -> None:
        """What the data on disk or in the config shows that would stop the run in its
        ranks: too few samples for one step, classes the model cannot tell apart."""
        # The ranks of a pipeline share their batches: its global batch is smaller.
        shards = 1 if "pipeline" in self.optimizations else world_size
        samples = getattr(self.data, "num_samples", None)
        batch = self.train.batch_size * shards
        if samples is not None and samples < batch:
            raise CombinationError(
                f"data.num_samples is {samples}, fewer than one step's batch ({batch}: "
                f"train.batch_size {self.train.batch_size} x {shards} rank(s), "
                "world.nprocs x world.nodes); raise data.num_samples, or lower "
                "train.batch_size or the ranks"
            )
        counted = getattr(self.data, "classes_on_disk", None)
        classes = counted() if counted is not None else None
        if classes is not None and classes < 2:
            raise CombinationError(
                f"{self.data.root} has {classes} class folder(s): a classifier needs at least "
                "2 (one folder of images per class)"
            )
        if classes is not None and classes != self.model.num_classes:
            raise CombinationError(
                f"model.num_classes is {self.model.num_classes} but {self.data.root} has "
                f"{classes} class folders: set model.num_classes: {classes}"
            )

    def _check_plan(self, optimizations: list[Optimization], world_size: int) -> None:
        """Each optimization's checks of itself and of this scenario's plan."""
        Scheduler(optimizations, self.scheduler.policy).check(
            world_size,
            self.device_type,
            self.backend,
            batch_size=self.train.batch_size,
            build_model=self.model.build,
            precision=self.train.precision,
            accumulate=self.train.accumulate,
            framework=self.framework,
        )
