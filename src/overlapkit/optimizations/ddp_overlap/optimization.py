"""``ddp_overlap``: hide the gradient all-reduce behind the backward pass.

Intensity maps onto DDP's bucket size: small buckets start all-reducing
early in backward (more overlap, more calls), one big bucket starts only
when backward is done. Intensity 0 is the no-overlap baseline: no DDP; all
gradients all-reduced once after backward as one flat buffer (like Horovod
without tensor fusion), the whole of it exposed.
"""

from __future__ import annotations

import inspect
import os
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ...runtime import (
    CombinationError,
    Knob,
    Optimization,
    Plan,
    Resource,
    State,
    WrapStage,
    register_optimization,
)
from ...runtime.gradsync import GradientSync
from ...runtime.timing import Marks
from .forward_watch import ForwardWatch, ScriptDDP
from .hooks import BucketCall, BucketTimer, SyncTiming, make_hook, wire_bytes_factor
from .profile import AllreduceProfile

# The first synchronised backward is not DDP's steady state: it all-reduces every
# gradient as one bucket once all are computed (torch 2.13, without
# find_unused_parameters), then rebuilds its buckets in the order the gradients
# became ready. The profile and the overlap figures start at the second one.
PROFILE_FROM_SYNC = 2

# torch 2.13 renamed DDP's broadcast_buffers (the knob keeps the name users know).
_SYNC_BUFFERS = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)

NCCL_ALGO = {"ring": "Ring", "tree": "Tree"}
NCCL_PROTO = {"simple": "Simple", "ll": "LL", "ll128": "LL128"}
NCCL_VARIABLES = (("nccl_algo", "NCCL_ALGO", NCCL_ALGO), ("nccl_proto", "NCCL_PROTO", NCCL_PROTO))


@register_optimization
class DDPOverlap(Optimization):
    """Overlaps gradient all-reduce with backward (DistributedDataParallel)."""

    name = "ddp_overlap"
    key_figures = {
        "buckets (packs) per step": ("buckets_per_step", "packs_per_step"),
        "all-reduce hidden": ("overlap.hidden_fraction",),
    }
    knobs = (
        Knob(
            name="mode",
            type=str,
            default="overlap",
            choices=("overlap", "no_overlap"),
            at_zero="no_overlap",
            help="no_overlap: one flat all-reduce after backward, the baseline",
        ),
        Knob(
            name="bucket_cap_mb",
            type=float,
            default=25.0,
            low=0.5,
            high=512.0,
            log=True,
            intensity=(256.0, 1.0),
            help="bucket size: smaller starts communication earlier",
        ),
        Knob(
            name="comm_hook",
            type=str,
            default="none",
            choices=("none", "fp16", "bf16", "powersgd"),
            needs="mode=overlap",  # no_overlap's one flat all-reduce has no hook
            help="compress gradients on the wire (bf16 needs nccl)",
            frameworks=("torch",),
        ),
        Knob(name="powersgd_rank", type=int, default=1, low=1, high=64, frameworks=("torch",)),
        Knob(
            name="powersgd_start_iter",
            type=int,
            default=10,
            low=2,
            high=1_000_000,
            frameworks=("torch",),
        ),
        Knob(name="gradient_as_bucket_view", type=bool, default=False, frameworks=("torch",)),
        Knob(name="static_graph", type=bool, default=False, frameworks=("torch",)),
        Knob(name="broadcast_buffers", type=bool, default=True, frameworks=("torch",)),
        Knob(name="find_unused_parameters", type=bool, default=False, frameworks=("torch",)),
        Knob(
            name="nccl_algo",
            type=str,
            default="default",
            choices=("default", "ring", "tree"),
            frameworks=("torch",),
        ),
        Knob(
            name="nccl_proto",
            type=str,
            default="default",
            choices=("default", "simple", "ll", "ll128"),
            frameworks=("torch",),
        ),
        Knob(
            name="implementation",
            type=str,
            default="auto",
            choices=("auto", "ring", "nccl"),
            help="tf.distribute's collective implementation (torch: world.backend decides)",
            frameworks=("tensorflow",),
        ),
    )
    resources = frozenset({Resource.NETWORK, Resource.HOST_CPU})
    provides = frozenset({"grad_sync"})
    wrap_stage = WrapStage.DATA_PARALLEL
    min_world_size = 2
    noop_alone = True  # the Python API leaves it out on one process (with a note)
    off_at_zero = False  # intensity 0 is the no-overlap baseline, still measured
    # TensorFlow: bucket_cap_mb becomes the strategy's bytes_per_pack (see `tensorflow`).
    engines = {"tensorflow": "overlapkit.optimizations.ddp_overlap.tensorflow"}

    def __init__(self, intensity: float = 1.0, **explicit: Any) -> None:
        super().__init__(intensity, **explicit)
        self.profile = AllreduceProfile()
        self.notes: list[str] = []
        self.ddp: DistributedDataParallel | None = None
        self._timer: BucketTimer | None = None
        self._marks = Marks()
        self._flat: GradientSync | None = None  # the no-overlap baseline
        self._watch: ForwardWatch | None = None  # a backward DDP cannot see is refused
        # Measured syncs and their steps, times not read yet (a step may sync several
        # times: each of LBFGS's closure's backwards, each of a GAN's).
        self._unread: deque[tuple[int, SyncTiming]] = deque()
        self._syncs = 0
        self._profiled_steps = 0
        self._read_step: int | None = None  # the step of the sync read last
        self._measured_calls = 0  # of the step's calls, those an earlier backward measured
        self._comm_busy_s = 0.0
        self._comm_exposed_s = 0.0
        self._last_buckets: list[int] = []

    @property
    def overlapping(self) -> bool:
        return self.settings["mode"] == "overlap"

    def check(self, world_size: int, device: str, backend: str) -> None:
        super().check(world_size, device, backend)
        if self.settings["comm_hook"] == "bf16" and backend != "nccl":
            raise CombinationError(
                f"ddp_overlap comm_hook bf16 needs the nccl back end; {backend} cannot "
                "all-reduce bfloat16 (use fp16 or none)"
            )
        if self.settings["implementation"] == "nccl" and device != "cuda":
            raise CombinationError(
                f"ddp_overlap implementation nccl needs GPUs; on {device} tf.distribute "
                "would use its ring instead, unsaid (use ring or auto)"
            )

    def check_plan(self, plan: Plan) -> None:
        if not plan.provided("stages"):
            return
        if plan.data_parallel_size < 2:
            raise CombinationError(
                f"ddp_overlap needs at least 2 replicas of each pipeline stage; {plan.world_size} "
                "ranks make 1 (add ranks, or leave ddp_overlap out)"
            )
        # Both checked with torch 2.13 on gloo, where PP x DDP is correct with
        # find_unused_parameters=True (which wrap_model turns on under a pipeline).
        if self.settings["static_graph"]:
            raise CombinationError(
                "ddp_overlap static_graph=true under a pipeline never all-reduces the last "
                "stage's gradients (the replicas silently diverge); leave it false"
            )
        if self.explicit.get("find_unused_parameters") is False:
            raise CombinationError(
                "ddp_overlap find_unused_parameters=false under a pipeline crashes GPipe on its "
                "second step (DDP reducer assert); leave it unset (a pipeline turns it on)"
            )

    # ----------------------------------------------------------------- set-up
    def wrap_model(self, model: nn.Module, state: State) -> nn.Module:
        world = state.world
        self._check_nccl_settings(world.backend)
        # NCCL works on the device's streams: time it there. gloo works on the host.
        self._marks = Marks(world.device if world.backend == "nccl" else None)
        if not self.overlapping:
            self._flat = GradientSync(model, state, around=self._timed_flat)
            return model
        if state.data_parallel is not None and not self.settings["find_unused_parameters"]:
            self.settings["find_unused_parameters"] = True
            self.notes.append(
                "find_unused_parameters turned on: a pipeline stage's DDP needs it (torch 2.13)"
            )
        if isinstance(model, nn.ModuleList):  # several pipeline stages on this rank
            return nn.ModuleList(self._wrap_one(part, state) for part in model)
        return self._wrap_one(model, state)

    def _wrap_one(self, model: nn.Module, state: State) -> DistributedDataParallel:
        if self.settings["comm_hook"] == "powersgd" and state.world.backend == "gloo":
            self._keep_powersgd_to_one_bucket(model)
        s = self.settings
        device = state.world.device
        self.ddp = ScriptDDP(
            model,
            process_group=state.dp.group,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=s["bucket_cap_mb"],
            gradient_as_bucket_view=s["gradient_as_bucket_view"],
            static_graph=s["static_graph"],
            find_unused_parameters=s["find_unused_parameters"],
            **{_SYNC_BUFFERS: s["broadcast_buffers"]},
        )
        if state.data_parallel is None:  # (a pipeline's schedule calls its stages' DDPs)
            self._watch = ForwardWatch(self.ddp)
        hook_state, hook = make_hook(s["comm_hook"], s, state.dp.group)
        if self._timer is None:  # one timer sees the buckets of every part
            self._timer = BucketTimer(hook, self._marks)
        self.ddp.register_comm_hook(hook_state, self._timer.hook)
        return self.ddp

    def _keep_powersgd_to_one_bucket(self, model: nn.Module) -> None:
        # Seen with torch 2.13: PowerSGD on gloo crashes a rank (SIGSEGV) once several
        # buckets are in flight; one bucket for all gradients runs correctly.
        grad_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        if self.settings["bucket_cap_mb"] > grad_mb:
            return
        self.settings["bucket_cap_mb"] = float(f"{grad_mb + 1:.4g}")
        self.notes.append(
            f"powersgd on gloo: bucket_cap_mb raised to {self.settings['bucket_cap_mb']} "
            "(one bucket); several buckets in flight crash a rank with torch 2.13"
        )

    def environment(self, backend: str) -> dict[str, str]:
        # NCCL reads these when a communicator is created: before the process group starts.
        if backend != "nccl":
            return {}
        return {
            variable: names[self.settings[knob]]
            for knob, variable, names in NCCL_VARIABLES
            if self.settings[knob] != "default"
        }

    def _check_nccl_settings(self, backend: str) -> None:
        for knob, variable, _ in NCCL_VARIABLES:
            value = self.settings[knob]
            if value == "default":
                continue
            if backend != "nccl":
                self.notes.append(
                    f"{knob}={value} recorded and ignored: it applies to nccl, not {backend}"
                )
            elif os.environ.get(variable) != self.environment(backend)[variable]:
                # A process group started by the caller, before these were known.
                os.environ[variable] = self.environment(backend)[variable]
                self.notes.append(
                    f"{variable} was set after the process group started: it applies only to "
                    "communicators created later (set it before init_process_group)"
                )

    # ------------------------------------------------------------------ hooks
    def on_step_start(self, state: State) -> None:
        if self._timer is not None:
            self._timer.calls = []
            self._measured_calls = 0
        while self._unread and self._unread[0][1].ready():
            self._read(*self._unread.popleft())

    def on_before_forward(self, state: State) -> None:
        if self.ddp is not None and state.accumulate > 1:
            # Skip the all-reduce on all but the last micro-batch of a step.
            self.ddp.require_backward_grad_sync = state.is_sync_step

    def on_after_backward(self, state: State) -> None:
        if not state.is_sync_step:
            return
        if self._flat is not None:
            self._flat.backward_ended()
        elif self._timer is not None:
            self._syncs += 1
            calls = self._timer.calls[self._measured_calls :]  # this backward's own
            self._measured_calls = len(self._timer.calls)
            if calls:
                self._measure(state, SyncTiming(calls, self._marks))

    def on_before_optimizer_step(self, state: State) -> None:
        if self._flat is not None:
            self._flat.sync()  # what no backward's end synced

    def on_fit_end(self, state: State) -> None:
        if self._flat is not None:  # the model outlives the run: no all-reduce after it
            self._flat.remove_hooks()
        if self._watch is not None:
            self._watch.remove()

    @contextmanager
    def _timed_flat(self) -> Iterator[None]:
        """The baseline (one flat all-reduce, see `GradientSync`), timed as one bucket."""
        self._syncs += 1
        call = BucketCall(0, self._flat.flat.bytes_per_call, self._marks.mark())
        yield
        call.completed = self._marks.mark()
        self._measure(self._flat.state, SyncTiming([call], self._marks), exposed_in_clock=True)

    def _measure(self, state: State, timing: SyncTiming, exposed_in_clock: bool = False) -> None:
        if not exposed_in_clock:
            # Exposed: communication still in flight after the last bucket started.
            state.clock.reattribute("backward", "comm_exposed", timing.exposed)
        if state.is_warmup or self._syncs < PROFILE_FROM_SYNC:
            return
        self._unread.append((state.step, timing))

    def _read(self, step: int, timing: SyncTiming) -> None:
        exposed, busy, calls = timing.values()
        factor = wire_bytes_factor(self.settings["comm_hook"])
        for nbytes, latency in calls:
            self.profile.add(int(nbytes * factor), latency)
        if step != self._read_step:  # the step's first sync
            self._read_step, self._last_buckets = step, []
            self._profiled_steps += 1
        self._comm_busy_s += busy
        self._comm_exposed_s += exposed
        self._last_buckets += [int(nbytes * factor) for nbytes, _ in calls]

    # ---------------------------------------------------------------- results
    def summary(self) -> dict[str, Any]:
        while self._unread:
            self._read(*self._unread.popleft())
        steps = self._profiled_steps
        busy = self._comm_busy_s / steps if steps else None
        exposed = self._comm_exposed_s / steps if steps else None
        return {
            **super().summary(),
            # None: nothing was measured (no step profiled: the run was too short; or no
            # communication), not "nothing hidden".
            "overlap": {
                "comm_busy_s_per_step": busy,
                "comm_exposed_s_per_step": exposed,
                "hidden_fraction": 1.0 - exposed / busy if busy and exposed is not None else None,
            },
            "buckets_per_step": len(self._last_buckets),
            "bytes_per_step": sum(self._last_buckets),
            "bucket_bytes": self._last_buckets,
            "allreduce_profile": {
                "profiled_steps": self._profiled_steps,
                "note": (
                    "rank 0, measured steps (not warm-up) from the 2nd synchronised backward "
                    "on: DDP's first all-reduces its gradients before rebuilding its buckets"
                    + (
                        "; bytes are the buckets' gradients before PowerSGD compresses them "
                        "(what it sends depends on each layer's shape and rank)"
                        if self.settings["comm_hook"] == "powersgd"
                        else ""
                    )
                ),
                "classes": self.profile.summary(),
            },
            "notes": self.notes,
            "tables": [self.profile.table("all-reduce calls by message size (rank 0)")],
        }
