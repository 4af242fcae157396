"""``pipeline``: the model's layers split into stages across ranks, fed micro-batch
by micro-batch by a schedule of ``torch.distributed.pipelining``.

The ranks form a 2-D mesh: ``stages`` pipeline ranks times ``world_size / stages``
replicas. Rank r is pipeline rank r // replicas of replica r % replicas; the
ranks of one replica read the same batches (the first stage uses the inputs,
the last the targets), and ``ddp_overlap`` averages each stage over its
replicas. Intensity maps onto the micro-batch count: more micro-batches, a
smaller bubble (p-1)/(m+p-1), smaller kernels.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler, default_collate

from ...data.sampler import ShardedSampler
from ...runtime import (
    CombinationError,
    DataParallel,
    Knob,
    Optimization,
    Plan,
    Resource,
    Shard,
    State,
    WrapStage,
    register_optimization,
)
from ...runtime.distributed import all_gather_objects
from ...runtime.persist import atomic_write
from . import partition
from .layers import SplitError, StageModule, sequential_layers
from .profile import measure_link, profile_layers
from .schedules import SCHEDULES, ScheduleKind

PARTITION_FILE = "pipeline-partition.json"


class PipelineError(CombinationError):
    """A pipeline setting that cannot work with this model, batch or set of ranks."""


@register_optimization
class Pipeline(Optimization):
    """Splits the model into stages across ranks, micro-batch by micro-batch."""

    name = "pipeline"
    key_figures = {
        "schedule": ("schedule",),
        "bubble": ("measured.bubble_fraction",),
        "ideal bubble": ("measured.ideal_bubble_fraction",),
    }
    knobs = (
        Knob(name="stages", type=int, default=2, low=2, high=1024, help="pipeline ranks"),
        Knob(
            name="microbatches",
            type=int,
            default=8,
            low=1,
            high=4096,
            log=True,
            intensity=(1, 16),
            help="per step; from intensity: the nearest count that divides the batch",
        ),
        Knob(name="schedule", type=str, default="1f1b", choices=tuple(SCHEDULES)),
        Knob(
            name="stages_per_rank",
            type=int,
            default=0,
            low=0,
            high=64,
            help="0: 1, or 2 for the multi-stage schedules",
        ),
        Knob(
            name="split",
            type=str,
            default="auto",
            help="auto (profile + PipeDream's partitioner), equal (layer count), or the "
            "names of the layers where stages 2.. begin",
        ),
        Knob(
            name="link_gbps",
            type=float,
            default=0.0,
            low=0.0,
            high=10_000.0,
            help="link speed for split: auto; 0 measures it",
        ),
    )
    resources = frozenset({Resource.NETWORK, Resource.COMPUTE})
    provides = frozenset({"stages", "forward_backward"})
    wrap_stage = WrapStage.SPLIT
    min_world_size = 2
    unavailable = {
        "tensorflow": "TensorFlow 2 has no pipeline-parallel schedule to build on; for "
        "PipeDream with tf.data input run it on torch (framework: torch) with "
        "optimizations.prefetch.backend: tfdata"
    }

    @classmethod
    def resolve(cls, intensity: float, explicit: dict[str, Any]) -> dict[str, Any]:
        if isinstance(explicit.get("split"), (list, tuple)):  # YAML: a list of layer names
            explicit = {**explicit, "split": ",".join(str(n) for n in explicit["split"])}
        return super().resolve(intensity, explicit)

    def __init__(self, intensity: float = 1.0, **explicit: Any) -> None:
        super().__init__(intensity, **explicit)
        self.kind: ScheduleKind = SCHEDULES[self.settings["schedule"]]
        self.meter: Any = None  # a StepMeter, on the first step
        self.notes: list[str] = []
        self.microbatches: int | None = None
        self.batch: int | None = None  # samples per step: the first batch's, fixed from then on
        self._scheduling = False  # the schedule runs the stages now (see _only_in_schedule)
        self.stage_ids: list[int] = []
        self.partition: list[dict[str, Any]] = []
        self.layer_costs: list[dict[str, Any]] = []
        self.link_bytes_per_s = 0.0
        self._parts: list[StageModule] = []
        self._schedule: Any = None
        self._pp_group: Any = None
        self._steps: list[Any] = []  # StepTimes, read at the end of the fit
        self._all_ranks: list[Any] = []

    # ---------------------------------------------------------------- layout
    @property
    def per_rank(self) -> int:
        return self.kind.stages_per_rank or self.settings["stages_per_rank"] or 2

    @property
    def pp(self) -> int:
        return self.settings["stages"]

    @property
    def total_stages(self) -> int:
        return self.pp * self.per_rank

    @property
    def holds_first(self) -> bool:
        """This rank runs the first stage (it takes the inputs)."""
        return 0 in self.stage_ids

    @property
    def holds_last(self) -> bool:
        """This rank runs the last stage (it takes the targets, computes the loss)."""
        return self.total_stages - 1 in self.stage_ids

    def data_shard(self, rank: int, world_size: int) -> tuple[int, int]:
        replicas = max(1, world_size // self.pp)
        return rank % replicas, replicas

    # ---------------------------------------------------------------- checks
    def check(self, world_size: int, device: str, backend: str) -> None:
        if world_size < 2:
            raise PipelineError(
                "pipeline needs at least 2 ranks, one per stage; this run has 1 "
                "(set world.nprocs, or leave pipeline out)"
            )
        if backend not in ("gloo", "nccl"):
            raise PipelineError(
                f"pipeline sends activations point to point; the {backend} back end cannot "
                "(use gloo or nccl)"
            )
        if device == "cuda" and backend == "gloo":
            raise PipelineError(
                "pipeline sends activations between GPUs point to point, and gloo cannot send "
                "CUDA tensors (its send/recv fails with 'Bad address'); set world.backend to "
                "nccl, or auto"
            )
        missing = self.kind.missing_in(torch.__version__)
        if missing:
            raise PipelineError(missing)
        if world_size % self.pp:
            raise PipelineError(
                f"pipeline stages={self.pp} must divide the {world_size} ranks "
                "(ranks = stages x replicas)"
            )
        fixed, asked = self.kind.stages_per_rank, self.settings["stages_per_rank"]
        if fixed and asked and asked != fixed:
            raise PipelineError(
                f"pipeline schedule {self.kind.name} runs {fixed} stage"
                f"{'s' if fixed != 1 else ''} per rank, "
                f"not stages_per_rank={asked}"
            )
        if not self.kind.multi and asked > 1:
            raise PipelineError(
                f"pipeline schedule {self.kind.name} runs one stage per rank; for "
                f"stages_per_rank={asked} use interleaved_1f1b, looped_bfs or interleaved_zb"
            )
        if "microbatches" in self.explicit:
            self._check_microbatches(self.settings["microbatches"])

    def _check_microbatches(self, m: int, batch: int | None = None) -> None:
        needed = {"ranks": self.pp, "stages": self.total_stages}.get(self.kind.min_microbatches, 1)
        if m < needed:
            counted = "stages" if self.kind.min_microbatches == "ranks" else "total_stages"
            raise PipelineError(
                f"pipeline schedule {self.kind.name} needs at least as many micro-batches as "
                f"stages: microbatches={m} < {counted}={needed}"
            )
        if self.kind.multi:
            rounds = max(1, m // self.pp)
            if m % rounds:
                raise PipelineError(
                    f"pipeline schedule {self.kind.name} needs microbatches to be a multiple of "
                    f"{rounds} (microbatches // stages); got {m}"
                )
        if batch is not None and batch % m:
            raise PipelineError(
                f"pipeline microbatches={m} must divide the batch of {batch} samples per replica"
            )

    @staticmethod
    def _check_accumulate(accumulate: int) -> None:
        if accumulate > 1:
            raise PipelineError(
                f"train.accumulate is {accumulate}, but pipeline splits each batch into "
                "micro-batches itself: set train.accumulate: 1 and raise microbatches instead"
            )

    def check_plan(self, plan: Plan) -> None:
        self._check_accumulate(plan.accumulate)
        if plan.precision == "fp16":
            raise PipelineError(
                "pipeline cannot train in fp16: its schedule runs each micro-batch's backward "
                "itself, where fp16's grad scaler never scales the loss (the first optimizer "
                "step would fail); use bf16 (on GPUs of compute capability 8.0 or more) or fp32"
            )
        if plan.batch_size is not None:
            self.resolve_microbatches(plan.batch_size)
        if plan.build_model is not None:
            try:
                names = [name for name, _ in sequential_layers(plan.build_model())]
                self._starts(names, costs=None)
            except SplitError as error:
                raise PipelineError(str(error)) from None

    def resolve_microbatches(self, batch: int) -> int:
        """The micro-batch count for a batch of ``batch``: as set, or (from intensity) the
        count nearest the mapped one that divides the batch and suits the schedule."""
        wanted = self.settings["microbatches"]
        if "microbatches" in self.explicit:
            self._check_microbatches(wanted, batch)
            return wanted
        candidates = []
        for m in range(1, batch + 1):
            try:
                self._check_microbatches(m, batch)
            except PipelineError:
                continue
            candidates.append(m)
        if not candidates:
            raise PipelineError(
                f"pipeline finds no micro-batch count for a batch of {batch} under schedule "
                f"{self.kind.name} with {self.pp} stages (a larger batch would do)"
            )
        return min(candidates, key=lambda m: (abs(m - wanted), m))

    # ---------------------------------------------------------------- set-up
    def wrap_model(self, model: nn.Module, state: State) -> nn.Module:
        world = state.world
        self._check_accumulate(state.accumulate)
        self.check(world.world_size, world.device.type, world.backend)
        replicas = world.world_size // self.pp
        pp_rank, dp_rank = divmod(world.rank, replicas)
        self._check_sampler(state.loader, dp_rank, replicas)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(world.device.type, (self.pp, replicas), mesh_dim_names=("pp", "dp"))
        self._pp_group = mesh["pp"].get_group()
        layers = sequential_layers(model)
        starts = self._agree_on_starts(layers, state, replicas)
        ends = [*starts[1:], len(layers)]
        self.stage_ids = self.kind.stage_ids(pp_rank, self.pp, self.per_rank)
        self._parts = [StageModule(layers[starts[s] : ends[s]]) for s in self.stage_ids]
        for part in self._parts:
            part.register_forward_pre_hook(self._only_in_schedule)
        state.data_parallel = DataParallel(
            dp_rank, replicas, mesh["dp"].get_group(), src=pp_rank * replicas
        )
        state.shard = Shard(f"stage{pp_rank:03d}", writer=dp_rank == 0)
        state.feeds_inputs = self.holds_first
        state.counts_samples = state.feeds_inputs
        return self._parts[0] if len(self._parts) == 1 else nn.ModuleList(self._parts)

    def _only_in_schedule(self, module: nn.Module, inputs: Any) -> None:
        """A stage runs inside the schedule only: a script's own ``model(x)`` (an
        evaluation of its own, after training) got this rank's stage's activations,
        not the model's outputs, silently on the first stage's rank."""
        if not self._scheduling:
            raise PipelineError(
                "under pipeline this rank holds only some layers (its stage), so model(x) "
                "gives that stage's activations, not the model's outputs: train with "
                "session.forward_backward(inputs, targets, loss_fn), evaluate with "
                "session.evaluate(loader)"
            )

    @contextmanager
    def _scheduled(self) -> Iterator[None]:
        self._scheduling = True
        try:
            yield
        finally:
            self._scheduling = False

    @staticmethod
    def _check_sampler(loader: Any, shard: int, shards: int) -> None:
        """The ranks of one pipeline must read the same batches (the first stage takes the
        inputs, the last the targets): a sampler sharded over all ranks, as a script
        builds it for data parallelism, would pair one rank's inputs with another's
        targets, silently."""
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, DistributedSampler):
            got = (sampler.rank, sampler.num_replicas)
        elif isinstance(sampler, ShardedSampler):
            got = (sampler.rank, sampler.world_size)
        else:
            return
        if got != (shard, shards):
            raise PipelineError(
                f"pipeline: the loader's {type(sampler).__name__} reads shard {got[0]} of "
                f"{got[1]}; under pipeline this rank must read shard {shard} of {shards}: "
                "the ranks of one pipeline read the same batches (the first stage takes "
                "the inputs, the last the targets). Build the sampler from "
                "session.data_shard: index, count = session.data_shard; "
                "DistributedSampler(dataset, num_replicas=count, rank=index)"
            )

    def wrap_optimizer(self, optimizer: Any, state: State) -> Any:
        # The optimizer was built over the whole model: keep this rank's parameters only.
        mine = {id(p) for part in self._parts for p in part.parameters()}
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in mine]
        return optimizer

    def _starts(self, names: list[str], costs: list[partition.LayerCost] | None) -> list[int]:
        try:
            return self._split(names, costs)
        except SplitError as error:
            if self.per_rank == 1:
                raise
            counted = f"{self.pp} stages x {self.per_rank} stages per rank"
            raise SplitError(f"{error} ({counted})") from None

    def _split(self, names: list[str], costs: list[partition.LayerCost] | None) -> list[int]:
        split = self.settings["split"]
        stages = self.total_stages
        if split == "equal":
            return partition.equal_count(len(names), stages)
        if split == "auto":
            partition.check_count(len(names), stages)
            if costs is None:  # checking only: the profile runs in the processes
                return []
            return partition.balanced(costs, stages, self.link_bytes_per_s)
        points = [name.strip() for name in split.split(",") if name.strip()]
        return partition.by_names(names, points, stages)

    def _agree_on_starts(
        self, layers: list[tuple[str, nn.Module]], state: State, replicas: int
    ) -> list[int]:
        """Rank 0 profiles and partitions; every rank takes its answer."""
        names = [name for name, _ in layers]
        costs = None
        if self.settings["split"] == "auto":
            gbps = self.settings["link_gbps"]
            # The link between pipeline ranks 0 and 1 of replica 0.
            self.link_bytes_per_s = (
                measure_link(0, replicas, state.world.device) if not gbps else gbps * 1e9 / 8
            )
        answer: Any = None
        if state.world.is_main:
            try:  # every rank must hear of a failure here, or the others wait forever
                answer = self._kept_partition(state, names)
                if answer is None:
                    if self.settings["split"] == "auto":
                        sample = self._sample_microbatch(state)
                        costs = profile_layers(layers, sample, state.world.device)
                    answer = (self._starts(names, costs), costs, self.link_bytes_per_s)
                    self._keep_partition(state, names, answer)
            except (SplitError, PipelineError) as error:
                answer = str(error)
        box = [answer]
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], str):
            raise PipelineError(box[0])
        starts, costs, self.link_bytes_per_s = box[0]
        if costs is not None:
            self.layer_costs = partition.as_dicts(costs)
            self.partition = partition.describe(costs, starts, self.link_bytes_per_s)
        else:
            ends = [*starts[1:], len(names)]
            self.partition = [
                {"stage": s, "layers": names[a:b]}
                for s, (a, b) in enumerate(zip(starts, ends, strict=True))
            ]
        return starts

    def state_dict(self) -> dict[str, Any]:
        # Each of this rank's stages' layers by the model's own names: its stage files
        # name them with underscores for dots, which overlapkit export undoes.
        # A checkpoint has one stage file per pipeline rank ("stage_files"): on machines
        # without a shared file system each holds only its own ranks' stages.
        return {
            "stages": [part.names for part in getattr(self, "_parts", [])],
            "stage_files": self.pp,
        }

    def saved_layout(self) -> dict[str, Any]:
        # A stage's checkpoint file holds that stage's layers (and a rank's, its stages').
        return {
            "stages": self.pp,
            "stages_per_rank": self.per_rank,
            "split": self.settings["split"],
        }

    # A profile differs from run to run: a run that resumes in the same folder must
    # split the model as the run that wrote the checkpoints did.
    def _partition_key(self, names: list[str]) -> dict[str, Any]:
        return {"split": self.settings["split"], "stages": self.total_stages, "layers": names}

    def _kept_partition(self, state: State, names: list[str]) -> Any:
        path = state.run_dir / PARTITION_FILE if state.run_dir is not None else None
        if path is None or not path.is_file():
            return None
        kept = json.loads(path.read_text())
        if kept["key"] != self._partition_key(names):
            return None
        costs = kept["costs"] and [partition.LayerCost(**c) for c in kept["costs"]]
        self.notes.append(f"the partition of the run that started in this folder ({path})")
        return kept["starts"], costs, kept["link_bytes_per_s"]

    def _keep_partition(self, state: State, names: list[str], answer: Any) -> None:
        if state.run_dir is None:
            return
        starts, costs, rate = answer
        kept = {
            "key": self._partition_key(names),
            "starts": starts,
            "costs": costs and partition.as_dicts(costs),
            "link_bytes_per_s": rate,
        }
        text = json.dumps(kept, indent=1).encode()
        atomic_write(state.run_dir / PARTITION_FILE, lambda fd: os.write(fd, text))

    def _sample_microbatch(self, state: State) -> Any:
        dataset = getattr(state.loader, "dataset", None)
        batch = getattr(state.loader, "batch_size", None)
        if dataset is None or not batch:
            raise PipelineError(
                "pipeline split: auto profiles the layers on a micro-batch of the loader's "
                "dataset, and this loader has none; pass the loader to prepare(), or set split "
                "to equal or to layer names"
            )
        size = max(1, batch // self.resolve_microbatches(batch))
        inputs = default_collate([dataset[i] for i in range(size)])[0]
        return inputs.to(state.world.device)

    def _build_schedule(self, state: State, loss_fn: Callable[..., torch.Tensor]) -> None:
        from .stage import StepMeter, TimedStage  # torch.distributed.pipelining: slow to import

        self.meter = StepMeter(state.world.device)
        parts = state.model if isinstance(state.model, nn.ModuleList) else [state.model]
        stages = [
            TimedStage(
                part,
                stage_id,
                self.total_stages,
                state.world.device,
                group=self._pp_group,
                meter=self.meter,
                part=stage_module,
            )
            for part, stage_module, stage_id in zip(parts, self._parts, self.stage_ids, strict=True)
        ]
        cls = self.kind.cls
        target = stages if self.kind.multi else stages[0]
        self._schedule = cls(target, self.microbatches, loss_fn=loss_fn)

    # ------------------------------------------------------------------ steps
    def forward_backward(
        self, state: State, inputs: Any, targets: Any, loss_fn: Callable[..., torch.Tensor]
    ) -> torch.Tensor | None:
        """One step's forward and backward through this rank's stages (`Session`
        calls it inside the forward phase; the time is split into phases here)."""
        batch = int(targets.shape[0])
        if self._schedule is None:
            self.microbatches = self.resolve_microbatches(batch)
            self.batch = batch
            with self._scheduled():
                self._build_schedule(state, loss_fn)
        elif batch != self.batch:
            # torch's schedule keeps the shapes of what a stage receives from its first
            # step: a later stage would run on the first batch's shape and meet targets
            # of another (a cryptic error in the loss, or, with a loss that broadcasts,
            # wrong gradients).
            raise PipelineError(
                f"pipeline: this batch has {batch} samples, the first had {self.batch}; "
                "torch's pipeline schedules fix the shapes the stages send at the first "
                "step, so every training batch must have the first one's size (a "
                "DataLoader's short last batch: drop_last=True)"
            )
        last = self.holds_last
        losses: list[torch.Tensor] = []
        self.meter.reset()
        begin = self.meter.marks.mark()
        with self._scheduled():
            self._schedule.step(
                *((inputs,) if self.holds_first else ()),
                target=targets if last else None,
                losses=losses if last else None,
                return_outputs=False,
            )
        # On a GPU the marks are events the device has not reached yet: the clock reads
        # these callables once the step is done, without making the host wait now.
        times = self.meter.close(begin, self.meter.marks.mark())
        state.clock.reattribute("forward", "backward", lambda: times.result()["backward_s"])
        state.clock.reattribute("forward", "bubble", lambda: times.result()["bubble_s"])
        if not state.is_warmup:
            self._steps.append(times)
        return torch.stack(losses).detach().mean() if last and losses else None

    @torch.no_grad()
    def evaluate_batch(self, state: State, inputs: Any, targets: Any) -> Any:
        """The last stage's outputs for ``inputs`` (None on other ranks)."""
        if self._schedule is None or self.batch is None:
            raise PipelineError("pipeline evaluates after the first training step")
        # The schedule runs batches of the training batch's shape only (torch fixes what
        # the stages send at its first step): a batch is evaluated in pieces of that
        # size, a short piece padded with copies of its last sample, their outputs dropped.
        outputs = []
        for start in range(0, int(targets.shape[0]), self.batch):
            piece = [t[start : start + self.batch] for t in (inputs, targets)]
            size = int(piece[1].shape[0])
            padding = self.batch - size
            if padding:
                piece = [torch.cat([t, t[-1:].expand(padding, *t.shape[1:])]) for t in piece]
            with self._scheduled():
                out = self._schedule.eval(*(piece[:1] if self.holds_first else ()), target=piece[1])
            if self.holds_last:
                outputs.append(out[:size])
        return torch.cat(outputs) if self.holds_last else None

    def on_fit_end(self, state: State) -> None:
        steps = [times.result() for times in self._steps]  # read now, at the latest
        self._all_ranks = all_gather_objects((state.world.rank, self.stage_ids, steps), state.world)

    # ---------------------------------------------------------------- results
    def summary(self) -> dict[str, Any]:
        out = {
            **super().summary(),
            "microbatches": self.microbatches,
            "stages_per_rank": self.per_rank,
            "total_stages": self.total_stages,
            "partition": self.partition,
            "link_gbps": self.link_bytes_per_s * 8 / 1e9,
            "notes": self.notes,
        }
        if self.layer_costs:
            out["layer_costs"] = self.layer_costs
        ranks = [entry for entry in self._all_ranks if entry[2]]
        if not ranks or self.microbatches is None:
            return out
        per_rank = []
        for rank, stage_ids, steps in ranks:
            mean = {key: statistics.fmean(s[key] for s in steps) for key in steps[0]}
            per_rank.append(
                {
                    "rank": rank,
                    "stages": stage_ids,
                    **mean,
                    "bubble_fraction": mean["bubble_s"] / mean["step_s"] if mean["step_s"] else 0,
                }
            )
        ideal = self.kind.ideal_bubble(self.pp, self.microbatches, self.per_rank)
        backward = statistics.fmean(r["backward_s"] for r in per_rank)
        out["measured"] = {
            "bubble_fraction": statistics.fmean(r["bubble_fraction"] for r in per_rank),
            "ideal_bubble_fraction": ideal,
            "bubble_s_per_step": statistics.fmean(r["bubble_s"] for r in per_rank),
            "step_s": statistics.fmean(r["step_s"] for r in per_rank),
            "sent_bytes_per_step": sum(r["sent_bytes"] for r in per_rank),
            # DDP all-reduces a stage's gradients in the last micro-batch's backward only.
            "ddp_window_fraction": statistics.fmean(r["last_backward_s"] for r in per_rank)
            / backward
            if backward
            else 0.0,
            "per_rank": per_rank,
        }
        return out
