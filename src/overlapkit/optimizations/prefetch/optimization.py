"""``prefetch``: the input pipeline overlapped with compute.

The back end (``torch``: DataLoader workers; ``tfdata``: a tf.data pipeline;
``dali``: an NVIDIA DALI pipeline) loads ``depth`` batches ahead with
``workers`` workers; a feeder thread keeps ``device_depth`` of them already
handed over (on a GPU: copied to the device on a side stream). At intensity
0 every batch is loaded on the training thread, when it is needed.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from ...data import ResumableLoader, ScriptLoader, SequenceLoader
from ...runtime import (
    CombinationError,
    Demand,
    Knob,
    Optimization,
    Plan,
    Resource,
    State,
    register_optimization,
)
from ...runtime.cores import available, rank_share
from .extras import missing
from .gated import GatedDataset
from .loader import PrefetchLoader

BACKENDS = ("torch", "tfdata", "dali")


class PrefetchError(TypeError):
    """The loader cannot be prefetched (not a `ResumableLoader`, nor a DataLoader that
    `Session.prepare` made resumable, for the torch back end)."""


@register_optimization
class Prefetch(Optimization):
    """Input loading and host-to-device copies overlapped with compute."""

    name = "prefetch"
    key_figures = {"backend": ("backend",), "workers": ("workers",), "depth": ("depth",)}
    knobs = (
        Knob(name="backend", type=str, default="torch", choices=BACKENDS),
        Knob(
            name="workers",
            type=int,
            default=2,
            low=0,
            high=64,
            intensity=(0, 4),
            help="loader worker processes (tf.data: parallel calls; DALI: Python workers)",
        ),
        Knob(
            name="depth",
            type=int,
            default=4,
            low=0,
            high=256,
            intensity=(1, 8),
            at_zero=0,
            help="batches loaded ahead by the back end",
        ),
        Knob(
            name="device_depth",
            type=int,
            default=1,
            low=0,
            high=16,
            intensity=(0, 2),
            help="batches handed over ahead by a feeder thread (on a GPU: already on the device)",
        ),
        Knob(
            name="pin_memory",
            type=bool,
            default=True,
            help="page-locked batches (GPU only)",
            frameworks=("torch",),
        ),
        # The torch back end's DataLoader workers (tf.data and DALI keep their own).
        Knob(
            name="persistent_workers",
            type=bool,
            default=True,
            frameworks=("torch",),
            needs="backend=torch",
        ),
        Knob(
            name="autotune",
            type=bool,
            default=False,
            help="tfdata: tf.data picks parallel calls and prefetch depth (AUTOTUNE)",
        ),
    )
    resources = frozenset({Resource.HOST_CPU, Resource.H2D})
    off_at_zero = False  # intensity 0 is a mode: synchronous loading, any back end
    # TensorFlow: the same knobs on the training loop's own tf.data pipeline.
    engines = {"tensorflow": "overlapkit.optimizations.prefetch.tensorflow"}

    def __init__(self, intensity: float = 1.0, **explicit: Any) -> None:
        super().__init__(intensity, **explicit)
        self.loader: PrefetchLoader | None = None
        self.fed = True  # False on a pipeline stage that takes no inputs
        self.script_workers: int | None = None  # the script's DataLoader's, where other
        self.cores = 0
        self.compute_threads = 0
        self.placed = False

    def check(self, world_size: int, device: str, backend: str) -> None:
        super().check(world_size, device, backend)
        reason = missing(self.settings["backend"])
        if reason:
            raise CombinationError(reason)

    def check_plan(self, plan: Plan) -> None:
        chosen = self.explicit.get("backend", "tfdata")
        if plan.framework == "tensorflow" and chosen != "tfdata":
            raise CombinationError(
                f"prefetch backend {chosen} feeds torch; with framework: tensorflow the "
                "training loop reads through tf.data (backend: tfdata, or leave it out)"
            )

    def wrap_loader(self, loader: Any, state: State) -> Any:
        if not state.feeds_inputs:
            # A pipeline stage after the first: it reads only the targets (the last
            # stage) or nothing it uses; prefetch feeds the stage that takes the inputs.
            self.fed = False
            return loader
        s = self.settings
        if isinstance(loader, ScriptLoader) and s["backend"] != "torch":
            raise PrefetchError(
                f"prefetch backend {s['backend']} reads an overlapkit.data.ResumableLoader; "
                "your own DataLoader is prefetched by the torch back end (backend: torch)"
            )
        if not isinstance(loader, (ResumableLoader, ScriptLoader)):
            got = type(loader).__name__
            if isinstance(loader, SequenceLoader):  # the script's own list of batches
                got = f"a {type(loader.items).__name__} of batches"
            elif isinstance(loader, DataLoader) and isinstance(loader.dataset, IterableDataset):
                got = f"a DataLoader over an IterableDataset ({type(loader.dataset).__name__})"
            elif hasattr(loader, "__next__"):
                got += " (pass the DataLoader itself, not an iterator over it)"
            raise PrefetchError(
                f"prefetch needs a map-style torch DataLoader or an overlapkit.data."
                f"ResumableLoader, got {got}: either keeps the position that exact resume needs"
            )
        if s["backend"] != "torch":  # an overlapkit loader (a script's was refused above)
            # tf.data and DALI call __getitem__ and stack the samples themselves.
            custom = [k for k in ("collate_fn", "worker_init_fn") if loader.loader_kwargs.get(k)]
            if custom:
                raise PrefetchError(
                    f"prefetch backend {s['backend']} stacks samples as torch's default "
                    f"collate does and has no {' or '.join(custom)}: the loader's own runs "
                    "with backend: torch"
                )
        device = state.world.device
        pin = s["pin_memory"] and device.type == "cuda"
        # Workers (processes, or a back end's threads) call the policy's gate before each
        # sample: on a CPU, under "priority", they wait while the step waits on
        # communication; under "partition" they move onto the cores it gives loading.
        on_cpu = device.type == "cpu"
        if s["workers"] and not isinstance(loader.dataset, GatedDataset):
            # Asked for only here: once made, every critical section also marks shared memory.
            worker_gate = state.policy.worker_gate("loader", Resource.HOST_CPU, on_cpu=on_cpu)
            if worker_gate is not None:
                loader.dataset = GatedDataset(loader.dataset, worker_gate)
        if isinstance(loader, ScriptLoader) and "persistent_workers" not in self.explicit:
            # The script's own DataLoader's choice: persistent workers draw the workers'
            # base seed once a run, not once an epoch, and the global RNG stream (dropout,
            # the next epoch's shuffle) would part from the plain script's after epoch 1.
            s["persistent_workers"] = bool(loader.original.persistent_workers)
        if isinstance(loader, ScriptLoader):
            # Each worker draws from its own RNG stream, and batch i comes from worker
            # i % workers: another count gives other random augmentations (a count
            # chosen by the intensity or given: either way the run is not the script's).
            if loader.original.num_workers != s["workers"]:
                self.script_workers = loader.original.num_workers
        backend = _build_backend(s, loader, device, pin)
        # DataLoader and DALI's external source load on the calling thread without
        # workers: the feeder thread loads ahead then. tf.data has threads of its own.
        feeder_depth = s["device_depth"]
        if s["backend"] in ("torch", "dali") and s["workers"] == 0:
            feeder_depth = max(feeder_depth, s["depth"])
        gate = partial(state.policy.pause, Resource.HOST_CPU) if on_cpu else None
        join = partial(state.policy.join, "feeder")
        self.loader = PrefetchLoader(loader, backend, device, feeder_depth, gate, join)
        world = state.world
        self.cores = len(rank_share(available(), world.local_rank, world.local_world_size))
        self.placed = state.policy.name == "partition"  # it divides the cores itself
        self.compute_threads = torch.get_num_threads()
        return self.loader

    def cpu_demands(self, state: State) -> list[Demand]:
        if self.loader is None:
            return []
        demands = [Demand("loader", self.settings["workers"], self.name)]
        if self.loader.feeder_depth:
            demands.append(Demand("feeder", 1, self.name))
        return [d for d in demands if d.threads]

    def on_fit_end(self, state: State) -> None:
        self.compute_threads = torch.get_num_threads()  # as the policy left them
        if self.loader is not None:
            self.loader.close()

    def summary(self) -> dict[str, Any]:
        out = {
            **super().summary(),
            "cores_per_rank": self.cores,
            "compute_threads": self.compute_threads,
            "feeder_depth": self.loader.feeder_depth if self.loader else 0,
            "notes": [],
        }
        if not self.fed:
            out["notes"].append("this rank's pipeline stage takes no inputs: not prefetched")
        if self.script_workers is not None:
            workers = self.settings["workers"]
            out["notes"].append(
                f"the script's DataLoader has {self.script_workers} workers, prefetch loads "
                f"with {workers}: random augmentation in the dataset or collate function draws "
                "other numbers than in the plain script (each worker has its own RNG stream; "
                "without workers, the global one), so the run differs from it; "
                + (
                    f"prefetch(intensity, workers={self.script_workers}) keeps its draws"
                    if self.script_workers
                    # workers=0 loads ahead on the feeder thread, whose draws interleave
                    # with training's (dropout): only synchronous loading keeps them
                    else "only intensity 0 keeps its draws (with workers=0 a feeder thread "
                    "loads ahead, its draws interleaved with training's)"
                )
            )
        busy = self.compute_threads + self.settings["workers"] + (1 if out["feeder_depth"] else 0)
        if self.cores and busy > self.cores and not self.placed:
            out["notes"].append(
                f"{self.settings['workers']} workers + {self.compute_threads} compute threads"
                f"{' + a feeder thread' if out['feeder_depth'] else ''} share {self.cores} "
                "cores: loading takes cores from compute (scheduler.policy: partition "
                "divides them by what each costs)"
            )
        return out


def _build_backend(
    settings: dict[str, Any], loader: ResumableLoader, device: torch.device, pin: bool
) -> Any:
    name, workers, depth = settings["backend"], settings["workers"], settings["depth"]
    if name == "tfdata":
        from .tfdata_backend import TfDataBackend

        return TfDataBackend(loader, workers, depth, settings["autotune"])
    if name == "dali":
        from .dali_backend import DaliBackend

        return DaliBackend(loader, workers, depth, device)
    from .torch_backend import TorchBackend

    return TorchBackend(loader, workers, depth, pin, settings["persistent_workers"])
