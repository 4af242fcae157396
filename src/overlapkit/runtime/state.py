"""What the hooks see: the loop's state at the moment an event fires."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .arbitration import ArbitrationPolicy
from .distributed import World
from .metrics import PhaseClock


@contextmanager
def temporarily(obj: Any, name: str, value: Any) -> Iterator[None]:
    """``obj.<name>`` is ``value`` inside the block and what it was after it."""
    before = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, before)


def is_warmup(step: int, warmup_steps: int, first_step: int) -> bool:
    """A step left out of the measurements: the run's first ``warmup_steps``, and, with
    any warm-up asked for, a resumed process's first step (its compilation, cold
    caches and allocator: a run measured from its start would not count them)."""
    return step < warmup_steps or (warmup_steps > 0 and step == first_step)


@dataclass(frozen=True)
class Shard:
    """Which copy of the replicated state (model, optimizer, ...) a rank holds.

    Ranks with the same ``name`` hold the same values, and its ``writer`` saves
    them once for all of them. Data parallelism: one shard, written by rank 0.
    Pipeline stages: one shard per stage, written by one replica of each.
    """

    name: str = "shared"
    writer: bool = True


@dataclass(frozen=True)
class DataParallel:
    """The ranks that hold the same part of the model and split the data between them.

    Without a pipeline that is every rank. ``group`` None means the whole world;
    ``src`` is the global rank of the first of them (where a broadcast starts).
    """

    rank: int = 0
    size: int = 1
    group: Any = None
    src: int = 0


@dataclass(eq=False)
class State:
    """Mutable loop state passed to every hook.

    ``step`` is the index of the current step (the number of optimizer steps
    completed before it); steps below ``warmup_steps`` are not measured. A
    step is ``accumulate`` micro-batches; ``micro_step`` is the current one.
    """

    world: World
    clock: PhaseClock
    policy: ArbitrationPolicy
    model: Any = None
    optimizer: Any = None
    loader: Any = None
    lr_scheduler: Any = None
    step: int = 0
    total_steps: int = 0
    warmup_steps: int = 0
    first_step: int = 0  # this process's first step (after a resume, the resumed one)
    accumulate: int = 1  # micro-batches per optimizer step
    micro_step: int = 0
    batch: Any = None
    outputs: Any = None
    loss: Any = None
    run_dir: Path | None = None
    zero_grad_in_place: bool = False  # gradients are views of a flat buffer: keep them
    script_ddp: Any = None  # the `DDPView` a script that wrapped its model in DDP trains
    in_no_sync: bool = False  # inside the script's `Session.no_sync()` block
    sync_on_backward: bool = True  # as the last training forward found `in_no_sync`
    in_session_call: bool = False  # a Session call (forward, backward...) is running
    # A training forward ran since the last optimizer step: a step boundary now falls
    # inside an update (a script accumulating batches itself, or fetching its next
    # batch before it updates), and a checkpoint taken there could not resume exactly.
    update_pending: bool = False
    fetches_ahead: bool = False  # the script's backward is of the step before's forward
    shard: Shard | None = None  # None: one shard for all ranks, written by rank 0
    data_parallel: DataParallel | None = None  # None: every rank (see `dp`)
    local_model: Any = None  # this rank's part of the model, before data-parallel wrapping
    feeds_inputs: bool = True  # False on pipeline stages after the first
    counts_samples: bool = True  # one rank per pipeline counts the samples of a step
    # Everything needed to resume exactly, as the session gathers it, and its inverse.
    capture: Callable[[], dict[str, Any]] | None = None
    restore: Callable[[dict[str, Any]], None] | None = None
    # The storages (by address) a checkpoint may copy after the step's start, because
    # only the optimizer step changes them; None from it: every captured tensor.
    # Unset: the torch model's parameters and optimizer state.
    deferrable: Callable[[], set[int] | None] | None = None
    # Optimizers the script registered besides the prepared one (a GAN's second): what
    # they step may change before the prepared optimizer's step, so it is never deferred.
    other_optimizers: list[Any] = field(default_factory=list)
    eval_results: list[dict[str, Any]] = field(default_factory=list)
    resumed_from: str | None = None  # the checkpoint a resume restored (its step folder)
    # What the run's checkpoints depend on (a scenario's model, data, optimizer, seed...),
    # recorded beside them and checked on resume; None: not known (a script of its own).
    setup: dict[str, Any] | None = None

    @property
    def replicated_shard(self) -> Shard:
        return self.shard or Shard(writer=self.world.is_main)

    @property
    def dp(self) -> DataParallel:
        return self.data_parallel or DataParallel(self.world.rank, self.world.world_size)

    @property
    def is_warmup(self) -> bool:
        return is_warmup(self.step, self.warmup_steps, self.first_step)

    @property
    def sync_wanted(self) -> bool:
        """Gradients are to be synced when this backward ends: the last micro-batch of
        a step, and not under the script's ``model.no_sync()`` or ``session.no_sync()``."""
        view = self.script_ddp
        return (
            self.is_sync_step and self.sync_on_backward and (view is None or view.sync_on_backward)
        )

    @property
    def is_sync_step(self) -> bool:
        """True on the last micro-batch of a step: gradients are synchronised and applied."""
        return self.micro_step == self.accumulate - 1
