"""The Python API for your own training loop.

    session = Session(optimizations, run_dir="runs/mine")
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    start = session.start(best=lambda: best_acc)   # resumes here, before your loop
    for epoch in range(start.epoch, epochs):
        for inputs, targets in loader:             # each batch is a step
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        with session.paused("evaluation"):
            accuracy = test(model)
    summary = session.finish()

Iterating the loader `prepare` returns is `session.epoch(loader)`: one epoch,
each batch a step with its events. The script's own ``model(x)``,
``loss.backward()`` and ``optimizer.step()`` fire the forward, backward and
optimizer events (see `script.PlainCalls`); ``session.forward()``,
``session.backward(loss)`` and ``session.optimizer_step()`` do the same
explicitly and are needed for fp16 loss scaling and ``accumulate``.
``session.steps(n)`` runs n steps in all, across epochs, instead of an epoch
loop. ``session.forward_backward(inputs, targets, loss_fn)`` is the form that
also runs under ``pipeline``.

The built-in loop (`overlapkit.runtime.loop`) is written on this same API, so
the optimizations see identical events in both.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from ..data import SequenceLoader
from .arbitration import ArbitrationPolicy
from .arguments import (
    check_group_unchanged,
    check_prepare_arguments,
    check_session_arguments,
    check_total_steps,
    wrapped_in_ddp,
)
from .batch import batch_size, fingerprint, to_device
from .distributed import World, all_gather_objects, all_reduce_sum, close_world, init_world
from .epochs import USED_UP, EpochLoop
from .events import Event
from .gradsync import DDPView, GradientSync
from .hardware import describe_node, nodes_of
from .hidden_modules import modules_out_of_sight, out_of_sight_message
from .hooks import SessionHook
from .metrics import PhaseClock, summarize
from .model_copies import CopyFinder, ModelCopy
from .optimization import Optimization, needed_environment
from .precision import Precision, PrecisionName, scaler_wait_note
from .progress import ProgressBar
from .report import LiveSteps, print_summary, write_run_files
from .saved_state import SavedState
from .scheduler import Scheduler
from .script import PlainCalls, PlainValues, PreparedSchedule, Start, StepLoader, note, warn
from .state import State, temporarily
from .steplog import PendingStep, StepLog
from .tensorboard import TensorBoardSteps
from .timing import AsyncScalar

# At a stop, how long the last steps' records may wait for the device (a step whose
# collective waits for a peer that is gone never finishes).
STOP_WAIT_S = 2.0


class Session(EpochLoop, SavedState):
    """Runs the user's loop under the scheduler: events, phase times, metrics,
    gradient sync across ranks, save and resume.

    Steps below ``warmup_steps`` run normally but are left out of the summary.
    With ``accumulate=k`` each step takes k micro-batches: `steps` yields k
    batches per step, `backward` scales the loss by 1/k, and `optimizer_step`
    does nothing until the last micro-batch. Without an optimization that
    provides ``grad_sync``, a multi-rank session averages gradients with one
    flat all-reduce when backward ends (as DistributedDataParallel does), so a
    script that clips or inspects gradients before the optimizer step sees them
    averaged.
    """

    def __init__(
        self,
        optimizations: Sequence[Optimization] = (),
        *,
        policy: ArbitrationPolicy | str = "free",
        world: World | None = None,
        device: str = "auto",
        precision: PrecisionName = "fp32",
        warmup_steps: int = 0,
        accumulate: int = 1,
        run_dir: str | Path | None = None,
        progress: bool = False,
        print_summary: bool = False,
        name: str = "session",
        trace: bool = False,
        tensorboard: str | Path | None = None,
    ) -> None:
        check_session_arguments(optimizations, policy, device, precision, warmup_steps, accumulate)
        # A process group this session starts, it also closes (in `finish`).
        self._owns_world = world is None and not torch.distributed.is_initialized()
        threads = torch.get_num_threads()
        self.world = world or init_world(
            device, environment=partial(needed_environment, optimizations)
        )
        # Never more threads than the script chose (torch.set_num_threads, torchrun's
        # OMP_NUM_THREADS): a port computes as the script did, bit for bit. In a group
        # the script started (mp.spawn's ranks keep torch's default), never fewer either.
        adopted = world is None and self.world.adopted
        torch.set_num_threads(threads if adopted else min(threads, torch.get_num_threads()))
        self.notes: list[str] = []
        optimizations = self._drop_single_process_noops(optimizations)
        self.scheduler = Scheduler(optimizations, policy)
        self.scheduler.check(
            self.world.world_size, self.world.device.type, self.world.backend, precision=precision
        )
        self.precision = Precision(precision, self.world.device)
        self.name = name
        self.state = State(
            world=self.world,
            clock=PhaseClock(self.world.device),
            policy=self.scheduler.policy,
            warmup_steps=warmup_steps,
            accumulate=accumulate,
            run_dir=Path(run_dir) if run_dir is not None else None,
        )
        self.state.capture = self.state_dict
        self.state.restore = self.load_state_dict
        self.records: list[dict[str, Any]] = []
        self._step_log = StepLog()
        self._show_progress = progress and self.world.is_main
        self._print_summary = print_summary and self.world.is_main
        self._trace = trace
        self._progress: ProgressBar | None = None
        self._tensorboard = tensorboard
        self._logs: list[LiveSteps | TensorBoardSteps] = []  # rank 0's step logs
        self._stateful: dict[str, Any] = {}
        # What the last restored checkpoint saved of registered objects: one registered
        # after session.load() is restored from it.
        self._loaded_user: dict[str, Any] = {}
        self._raw_model: nn.Module | None = None
        self._grad_sync: GradientSync | None = None
        # A registered model's (a GAN's generator) on several ranks, and the hooks that
        # sync it before its optimizer's step.
        self._registered_syncs: list[GradientSync] = []
        self._registered_sync_hooks: list[Any] = []
        self._epoch = 0
        self._epoch_batches = 0  # batches of the current epoch the script was handed
        self._batches_before_resume = 0  # of the resumed epoch, trained before its checkpoint
        self._left_pass = False  # the script left the epoch's pass (a break)
        # False under overlapkit's own loop (`run`): notes about a script's ways stay out.
        self.runs_a_script = True
        self._started = False
        self._start: Start | None = None
        self._in_step = False
        self._paused = 0
        self._nested_s: list[float] = []  # per open pause, the time of pauses inside it
        self._outside_s: dict[str, float] = defaultdict(float)  # time outside any step
        self._gap_since: float | None = None  # between epochs, since
        self._labelled_in_gap = 0.0
        self._steps_this_run = 0
        self.finished = False  # finish() wrote the results: an interrupt now cuts no step
        self._optimizer_steps = 0  # this run's
        self._forwards_in_step = 0  # training forwards of the step now open
        self._end_failed = False  # a STEP_END hook raised: the step is not ended again
        self._save_warned: set[str] = set()  # kinds of session.save() told inexact
        # Unregistered copies of the model, watched until the run changes them.
        self._copies: dict[str, ModelCopy] = {}
        self._copies_told: dict[str, Any] = {}  # (and what they named)
        self._copy_finder: CopyFinder | None = None  # set while copies are watched
        self._saves = 0  # session.save() calls on this rank (the ranks meet at each)
        self._save_meetings: str | None = None  # their names' prefix (`meet_for_saves_from`)
        self._rng_at_save: tuple[Path, dict[str, Any]] | None = None  # the last save's
        # (epoch, batch) of a resume mid-epoch, until its first batch is done (watched)
        self._resumed_mid_epoch: tuple[int, int] | None = None
        self._rng_at_resume: dict[str, Any] | None = None  # as the resume left it
        self._values = PlainValues()
        self._plain_calls = PlainCalls(self)
        self._schedule: PreparedSchedule | None = None
        self._step_samples = 0
        self._micro_losses: list[torch.Tensor] = []

    # ----------------------------------------------------------------- set-up
    def prepare(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        loader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple[Any, Any, Any]:
        """Move the model to the device and apply every optimization's wrappers.

        A model already wrapped in DistributedDataParallel (or DataParallel) is unwrapped:
        the session syncs gradients itself (``ddp_overlap``, or one flat all-reduce, when
        the model returned is a `DDPView`: ``.module`` and ``no_sync()`` still work). One
        that FSDP shards, or with DTensor parameters, is refused. A map-style
        DataLoader is made resumable in its own order (`ScriptLoader`). The loader
        returned runs one epoch of steps when iterated (`epoch`); ``lr_scheduler`` is
        stepped after every optimizer step (register one stepped per epoch with
        `register_for_checkpointing` or `start` instead)."""
        check_prepare_arguments(model, optimizer, prepared=self._raw_model is not None)
        check_group_unchanged(self.world.world_size)
        came_in_ddp = isinstance(model, DistributedDataParallel)
        came_wrapped = isinstance(model, (DistributedDataParallel, nn.DataParallel))
        model = self._unwrapped(model)
        whole = _unsharded(loader)
        loader = self._resumable(loader)
        model = model.to(self.world.device)
        state = self.state
        state.model, state.optimizer, state.loader = model, optimizer, loader
        state.lr_scheduler = lr_scheduler
        if lr_scheduler is not None and optimizer is not None:
            self._schedule = PreparedSchedule(lr_scheduler, optimizer)
        self.scheduler.wrap(state)
        self._raw_model = state.local_model  # this rank's part of the model, unwrapped
        if state.dp.size > 1 and not self.scheduler.provides("grad_sync"):
            self._grad_sync = GradientSync(state.local_model, state)
        if state.dp.size > 1 and not came_in_ddp and self.runs_a_script:
            self._note(
                f"the model came without DistributedDataParallel, on {state.dp.size} ranks: "
                "overlapkit makes it data-parallel, as DDP would (every rank starts from the "
                "first rank's parameters and buffers, gradients are averaged after each "
                "backward, batch-norm statistics are the first rank's); a script that keeps "
                "its ranks apart (local SGD, one model per rank) cannot run them in one session"
            )
        if state.dp.size > 1 and self.runs_a_script and self._same_batch_on_every_rank(loader):
            self._note(
                f"every rank trains the same batches: the list given to prepare starts with "
                f"the same batch on all {state.dp.size} ranks, so each step trains it "
                f"{state.dp.size} times (once per rank, the averaged gradient that of one) and "
                f"the summary counts its samples {state.dp.size} times; give each rank its "
                "own part: index, count = session.data_shard; batches[index::count] (or its "
                "rows of a full batch, rows[index::count])"
            )
        if state.dp.size > 1 and self.runs_a_script and whole is not None:
            self._note(
                f"every rank reads the whole data set, unless each rank's is its own part "
                f"(a Subset by rank): the loader's sampler is {whole}, not a "
                f"DistributedSampler, so each epoch trains every sample {state.dp.size} "
                f"times (once per rank) and the summary counts it {state.dp.size} times; "
                "shard it as a DDP script does: index, count = session.data_shard; "
                "DataLoader(dataset, sampler=DistributedSampler(dataset, num_replicas=count, "
                "rank=index), ...), with sampler.set_epoch(epoch) each epoch"
            )
        if self.precision.scaler is not None and optimizer is not None:
            if waits := scaler_wait_note(optimizer):
                self._note(waits)
        self._plain_calls.install(state.model, state.optimizer)
        loader = StepLoader(self, state.loader) if state.loader is not None else None
        if came_wrapped and not isinstance(state.model, DistributedDataParallel):
            state.script_ddp = DDPView(state.model)  # `.module`, `no_sync()` keep working
            return state.script_ddp, state.optimizer, loader
        return state.model, state.optimizer, loader

    def _same_batch_on_every_rank(self, loader: Any) -> bool:
        """Whether a script's list of batches (a `SequenceLoader`) starts with the same
        batch on every rank of the data-parallel world (a collective: every rank of a
        script passes a list, or none does)."""
        if not isinstance(loader, SequenceLoader) or self.state.dp.size != self.world.world_size:
            return False
        mine = fingerprint(loader.items[0]) if len(loader.items) else None
        prints = all_gather_objects(mine, self.world)
        return mine is not None and all(p == mine for p in prints)

    @property
    def data_shard(self) -> tuple[int, int]:
        """(index, count): the shard of the data this rank reads. Every rank its own,
        unless the model is split across ranks: then the ranks of one pipeline share one."""
        return self.scheduler.data_shard(self.world.rank, self.world.world_size)

    # ------------------------------------------------------------------ steps
    def steps(self, total_steps: int, loader: Any = None) -> Iterator[Any]:
        """Yield one batch per step until ``total_steps`` steps are done (counting
        resumed ones), starting a new epoch whenever the loader runs out."""
        check_total_steps(total_steps)
        if self._raw_model is None:
            raise RuntimeError(
                "call session.prepare(model, optimizer, loader) before steps(): it puts the "
                "model on the device and hooks the optimizations in"
            )
        loader = self._unwrap_loader(loader)
        if loader is None:
            raise ValueError("steps() has no loader: give one to prepare() or to steps()")
        self.state.total_steps = total_steps
        self._fit_start(total_steps)
        if self._left_pass:  # an epoch loop's pass left before: steps() starts anew
            self._next_epoch(loader)
        state = self.state
        iterator: Iterator[Any] | None = None
        try:
            while state.step < total_steps:
                self.start_step()
                for micro_step in range(state.accumulate):
                    state.micro_step = micro_step
                    with state.clock.phase("data_wait"):
                        batch, iterator = self._next_batch(loader, iterator)
                    yield self._arrived(batch)
                if self._in_step:
                    self.end_step()
        except GeneratorExit:
            if self._step_to_end:  # a break in the script's loop: the step it finished
                self.end_step()
            raise
        except BaseException:
            # The session failed (a checkpoint on a full disk, an interrupt): the step
            # stays open (it did not happen); the progress bar and step logs close.
            self._close_displays()
            raise

    def _next_batch(self, loader: Any, iterator: Iterator[Any] | None) -> tuple[Any, Iterator[Any]]:
        for _attempt in range(2):
            if iterator is None:
                iterator = self._new_epoch(loader)
            try:
                batch = next(iterator)
                self._say_inexact(loader)
                break
            except StopIteration:
                iterator = None
                self._epoch += 1
                self._epoch_batches = self._batches_before_resume = 0
        else:
            used_up = USED_UP if iter(loader) is loader else ""  # one pass only
            raise RuntimeError(f"the loader yielded no batch in a whole epoch{used_up}")
        if getattr(loader, "position", None) is None:
            # Counted as in an epoch loop: a checkpoint's place in the epoch, and a loader
            # that restarted its epoch after a resume (trained those batches twice,
            # unsaid). One with a place of its own says where it is itself (counted, its
            # epoch's end was saved as the next epoch's start, and its epoch moved twice).
            self._epoch_batches += 1
            self._check_restarted_epoch(loader)
        return batch, iterator

    def _arrived(self, batch: Any) -> Any:
        """A step's batch is here: on the device, counted, AFTER_DATA fired."""
        if self.world.device.type != "cpu":
            batch = to_device(batch, self.world.device)
        self.state.batch = batch
        self._step_samples += batch_size(batch)
        self.scheduler.fire(Event.AFTER_DATA, self.state)
        return batch

    def _new_epoch(self, loader: Any) -> Iterator[Any]:
        # steps() owns the epoch loop: it sets the sampler's epoch, from the loader's own
        # count where it keeps one (resumable loaders), else from the session's.
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(int(getattr(loader, "epoch", self._epoch)))
        return iter(loader)

    def _fit_start(self, total_steps: int | None) -> None:
        if self._started:
            return
        self._started = True
        loaded = self.state.resumed_from  # by session.load(), which said so
        self.check_unsaved_state()
        self._tell_modules_out_of_sight()
        self._registered_models_data_parallel()
        if self.world.world_size > 1 and self._save_meetings is None:  # every rank, here
            self.meet_for_saves_from(dist.distributed_c10d._get_default_store())
        self.scheduler.fire(Event.FIT_START, self.state)  # may resume: state.step moves on
        self.state.first_step = self.state.step
        if loaded is None:
            self.check_saves_left_behind()
        self.scheduler.arrange(self.state)
        self._start = self._where()
        if self._start.resumed_from is not None and self._start.resumed_from != loaded:
            self._watch_resumed_batch(self._start)
            if self.world.is_main:
                note(self._start.describe())
        if self._show_progress and ProgressBar.wanted():
            self._progress = ProgressBar(self.name, total_steps, done=self.state.step)
        if self.world.is_main and self.state.run_dir is not None:
            self._logs.append(LiveSteps(self.state.run_dir))
        if self.world.is_main and self._tensorboard is not None:
            self._logs.append(
                TensorBoardSteps(
                    self._tensorboard,
                    self.scheduler.optimizations,
                    "torch",
                    self.scheduler.policy.name,
                )
            )

    def _tell_modules_out_of_sight(self) -> None:
        """The prepared model keeps trainable modules or tensors out of nn.Module's
        sight (mnist_forward_forward's layers in a plain list), registered nowhere: a
        script's own bug, told (checkpoints miss them, ranks do not sync them), not
        refused."""
        if self._raw_model is None:
            return
        registered = {
            id(p)
            for obj in self._stateful.values()
            if isinstance(obj, nn.Module)
            for p in obj.parameters()
        }
        if hidden := modules_out_of_sight(self._raw_model, registered):
            message = out_of_sight_message(hidden)
            self.notes.append(message)
            warn(message)

    def _registered_models_data_parallel(self) -> None:
        """On several ranks, a registered model that an optimizer trains (a GAN's
        generator, by its own registered optimizer or by the prepared one) is made
        data-parallel as the prepared one is: every rank starts from the first rank's
        parameters and buffers (before a resume restores them), its gradients are
        averaged with one flat all-reduce when a backward that reached them ends, and
        what none synced is before its optimizer's step. Left alone, each rank trained
        its own, silently. One the script wrapped in DistributedDataParallel syncs
        itself (registered as the wrapper or as its ``.module``); one that shares
        parameters with the prepared model is told, not synced."""
        state = self.state
        if state.dp.size < 2 or self._raw_model is None or not self.runs_a_script:
            return
        prepared = {id(p) for p in self._raw_model.parameters()}
        trainers = [*state.other_optimizers, *([state.optimizer] if state.optimizer else [])]
        in_ddp: set[int] | None = None  # looked for once a module would be synced
        for name, obj in self._stateful.items():
            if not isinstance(obj, nn.Module) or isinstance(obj, DistributedDataParallel):
                continue
            params = {id(p) for p in obj.parameters() if p.requires_grad}
            own = params - prepared  # the prepared model itself, registered, has none
            optimizers = [
                optimizer
                for optimizer in trainers
                if any(id(p) in own for g in optimizer.param_groups for p in g["params"])
            ]
            if not optimizers:
                continue
            if in_ddp is None:
                in_ddp = wrapped_in_ddp()
            if id(obj) in in_ddp:  # the script's own DDP syncs it
                continue
            if params & prepared:
                self._note(
                    f"{name} shares parameters with the prepared model: overlapkit syncs "
                    f"the prepared model's gradients only, so on {state.dp.size} ranks each "
                    f"trains its own copy of {name}'s other parameters; prepare the model "
                    "that holds both (or wrap it in DistributedDataParallel yourself)"
                )
                continue
            # Zeroing the prepared optimizer's gradients stays as it was (in place, or not).
            with temporarily(state, "zero_grad_in_place", state.zero_grad_in_place):
                sync = GradientSync(obj, state)
            self._registered_syncs.append(sync)
            for optimizer in optimizers:
                hook = optimizer.register_step_pre_hook(SessionHook(partial(_sync_left, sync)))
                self._registered_sync_hooks.append(hook)
            self._note(
                f"{name} came without DistributedDataParallel, on {state.dp.size} ranks: "
                "registered and trained by an optimizer, overlapkit makes it "
                "data-parallel too (every rank starts from the first rank's, its gradients "
                "are averaged with one flat all-reduce when backward ends; ddp_overlap "
                "overlaps the prepared model's only)"
            )

    def start_step(self) -> None:
        if self._gap_since is not None:  # the time since the last epoch ended
            gap = perf_counter() - self._gap_since - self._labelled_in_gap
            self._outside_s["between_epochs"] += max(gap, 0.0)
            self._gap_since = None
        self.check_draws_since_save()
        self.state.clock.start_step()
        self._in_step = True
        self._step_samples = 0
        self._forwards_in_step = 0
        self._end_failed = False
        self._micro_losses.clear()
        self._plain_calls.step_starts()
        self.scheduler.fire(Event.STEP_START, self.state)

    @contextmanager
    def forward(self) -> Iterator[None]:
        """Run the forward pass (and loss) inside this block, under autocast if set."""
        self.training_forward_starts()
        self.scheduler.fire(Event.BEFORE_FORWARD, self.state)
        clock = self.state.clock
        clock.switch("forward")
        with self.precision.autocast(), self._session_call():
            yield
        clock.switch(self._plain_calls.resting)  # the optimizer's, inside a closure
        self.scheduler.fire(Event.AFTER_FORWARD, self.state)

    def training_forward_starts(self) -> None:
        """An update begins (see `State.update_pending`); whether its backward syncs
        is read now, as DDP reads its flag at the forward (`State.sync_wanted`)."""
        state = self.state
        self._forwards_in_step += 1
        state.update_pending = state.optimizer is not None
        state.sync_on_backward = not state.in_no_sync  # read at the forward, as DDP's flag

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's ``model.no_sync()`` for whatever model the session trains (a script
        accumulating micro-batches with a plain model): the backward of a forward run
        inside is not synced when it ends; a later backward's sync, or the optimizer
        step, takes its gradients along."""
        model = self.state.model
        if isinstance(model, DistributedDataParallel):  # ddp_overlap's own DDP
            with model.no_sync():
                yield
            return
        with temporarily(self.state, "in_no_sync", True):
            yield

    @contextmanager
    def _session_call(self) -> Iterator[None]:
        """The session fires this call's events itself: the script-call hooks stand aside."""
        with temporarily(self.state, "in_session_call", True):
            yield

    def forward_backward(
        self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]
    ) -> torch.Tensor | None:
        """Forward, loss and backward of one batch: ``loss_fn(model(inputs), targets)``.

        Under ``pipeline`` the batch goes through this rank's stages in micro-batches
        by the pipeline's schedule; the loss (mean over micro-batches) is returned on
        the rank of the last stage, None on the others.
        """
        runner = self.scheduler.provider("forward_backward")
        if runner is None:
            with self.forward():
                loss = loss_fn(self.state.model(inputs), targets)
            self.backward(loss)
            return loss
        state = self.state
        self.training_forward_starts()
        self.scheduler.fire(Event.BEFORE_FORWARD, state)
        state.clock.switch("forward")
        with self.precision.autocast(), self._session_call():
            loss = runner.forward_backward(state, inputs, targets, loss_fn)
        state.clock.switch("other")
        state.loss = loss
        if loss is not None:
            self._micro_losses.append(loss.detach())
        for event in (Event.AFTER_FORWARD, Event.BEFORE_BACKWARD, Event.AFTER_BACKWARD):
            self.scheduler.fire(event, state)
        self.backward_ended()
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        state = self.state
        state.loss = loss
        self._micro_losses.append(loss.detach())
        self.scheduler.fire(Event.BEFORE_BACKWARD, state)
        clock = state.clock
        clock.switch("backward")
        with self._session_call():
            self.precision.backward(loss / state.accumulate if state.accumulate > 1 else loss)
        clock.switch(self._plain_calls.resting)
        self.scheduler.fire(Event.AFTER_BACKWARD, self.state)
        self.backward_ended()

    def backward_ended(self) -> None:
        """Average the gradients now (the flat all-reduce, when no optimization syncs
        them), as DDP does when backward ends: the script's own use of them before the
        optimizer step (clipping, a grad scaler's inf check, their norm) sees the
        averaged values. Called when any backward pass that changed them ends (the
        flat all-reduce's hooks) and after the session's own backward. Not on a
        micro-batch before a step's last, nor under the script's ``model.no_sync()``:
        the optimizer step syncs what is left."""
        if self._grad_sync is not None:
            self._grad_sync.backward_ended()
        for sync in self._registered_syncs:  # a registered model's (a GAN's generator)
            sync.backward_ended()

    def optimizer_step(self) -> None:
        """Sync gradients if nothing else does, step optimizer and LR schedule, zero
        grads; on any but the last micro-batch of a step, do nothing."""
        state = self.state
        if state.optimizer is None:
            raise RuntimeError("optimizer_step(): prepare() was given no optimizer")
        if not state.is_sync_step:
            return
        self.before_optimizer_step()
        with self._session_call():
            self.precision.step(state.optimizer)
        state.optimizer.zero_grad(set_to_none=not state.zero_grad_in_place)
        self.after_optimizer_step()

    def before_optimizer_step(self) -> None:
        """Sync gradients if the end of backward did not (a backward the session did
        not see); BEFORE_OPTIMIZER_STEP."""
        state = self.state
        if self._schedule is not None:
            self._schedule.check()
        if self._grad_sync is not None:
            self._grad_sync.sync()  # what no backward's end synced
        self.scheduler.fire(Event.BEFORE_OPTIMIZER_STEP, state)
        state.clock.switch("optimizer")

    def after_optimizer_step(self) -> None:
        """Step the LR schedule given to `prepare`; AFTER_OPTIMIZER_STEP."""
        state = self.state
        state.update_pending = False
        self._optimizer_steps += 1
        if self._schedule is not None:
            self._schedule.step()
        state.clock.switch("other")
        self.scheduler.fire(Event.AFTER_OPTIMIZER_STEP, state)

    def end_step(
        self, loss: torch.Tensor | float | None = None, samples: int | None = None
    ) -> None:
        """Close the step: fire STEP_END, record its metrics, advance the step counter.

        Nothing here waits for the device: the step's times and loss are read when
        they are ready (a few steps later on a GPU; `finish` reads the rest)."""
        state = self.state
        try:
            self.scheduler.fire(Event.STEP_END, state)
        except BaseException:
            # The step stays open (it did not happen), but is not ended again when the
            # script's loop closes its generator: the error is raised once.
            self._end_failed = True
            raise
        timing = state.clock.close_step()
        if loss is None and self._micro_losses:
            loss = torch.stack(self._micro_losses).mean()
        if samples is None:
            samples = self._step_samples if state.counts_samples else 0
        self._step_log.add(
            PendingStep(
                step=state.step,
                rank=self.world.rank,
                samples=samples,
                warmup=state.is_warmup,
                timing=timing,
                # None: this rank computes no loss (a pipeline stage before the last).
                loss=AsyncScalar(loss) if isinstance(loss, torch.Tensor) else loss,
            )
        )
        for record in self._step_log.ready():
            self._record(record)
        state.step += 1
        self._steps_this_run += 1
        self._in_step = False
        state.policy.step_done(state, self._step_samples)

    def _record(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        rate = record["samples_per_s"] * self.state.dp.size
        if self._progress is not None:
            self._progress.advance(rate, record["loss"], record["warmup"])
        for log in self._logs:
            log.write(record, rate)

    # ------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self, loader: Any) -> dict[str, Any]:
        """Classification accuracy and loss over ``loader`` (each rank passes its
        own shard); the counts are summed across ranks."""
        with self.paused("evaluation"):  # reported on its own, not in any step
            return self._evaluate(loader)

    def _evaluate(self, loader: Any) -> dict[str, Any]:
        state = self.state
        self.scheduler.fire(Event.EVAL_START, state)
        start = perf_counter()
        model = state.model
        model.eval()
        # Summed on the device, read once at the end: no wait for the device per batch.
        sums = torch.zeros(3, dtype=torch.float64, device=self.world.device)
        runner = self.scheduler.provider("forward_backward")
        with self.precision.autocast():
            for inputs, targets in loader:
                inputs = to_device(inputs, self.world.device)
                targets = to_device(targets, self.world.device)
                if runner is None:
                    outputs = model(inputs)
                else:  # only the last stage has outputs; the counts are summed over ranks
                    outputs = runner.evaluate_batch(state, inputs, targets)
                    if outputs is None:
                        continue
                sums[0] += (outputs.argmax(-1) == targets).sum()
                sums[1] += targets.shape[0]
                sums[2] += F.cross_entropy(outputs.float(), targets, reduction="sum")
        model.train()
        correct, total, loss_sum = all_reduce_sum(sums, self.world).tolist()
        result = {
            "step": state.step,
            "accuracy": correct / total if total else 0.0,
            "loss": loss_sum / total if total else 0.0,
            "samples": int(total),
            "time_s": perf_counter() - start,
        }
        state.eval_results.append(result)
        self.scheduler.fire(Event.EVAL_END, state)
        return result

    # ---------------------------------------------------------------- finish
    def stopped(self) -> tuple[int, int | None]:
        """After an interrupt: write the steps still on their way from the device (on a
        GPU the last few, waited for up to `STOP_WAIT_S`), close the progress display;
        return the step reached and the step of the newest complete checkpoint (None:
        none)."""
        try:
            if self._progress is not None or self._logs:  # (not closed by an earlier call)
                for record in self._step_log.settle(STOP_WAIT_S):
                    self._record(record)
        except (RuntimeError, KeyboardInterrupt):
            pass  # a device in error has no times to give; a second Ctrl-C ends the wait
        finally:
            self._close_displays()
        checkpoint = self.checkpoint
        return self.state.step, checkpoint.newest_step() if checkpoint is not None else None

    def _close_displays(self) -> None:
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        for log in self._logs:
            log.close()
        self._logs.clear()

    def finish(self) -> dict[str, Any]:
        """Drain background work (FIT_END), gather metrics from all ranks, write
        ``steps.jsonl`` and ``summary.json`` to the run folder; return the summary.
        A process group the session started itself is closed: call it last."""
        if self._step_to_end:  # a loop left mid-step (an exception, a generator not closed)
            self.end_step()
        self.scheduler.fire(Event.FIT_END, self.state)
        self.scheduler.policy.close()
        self._check_copies_changed(wait=True)  # (a GPU's sums came one checkpoint late)
        self._warn_if_no_steps()
        updates, steps = self._optimizer_steps, self._steps_this_run
        if self.state.optimizer is not None and 0 < updates != steps:
            self._note(
                f"{steps} steps and {updates} optimizer steps: a step is a batch of the "
                "loader the session returned (step times, checkpoints' every count them)"
            )
        for record in self._step_log.drain():
            self._record(record)
        self._close_displays()
        gathered = all_gather_objects(
            (
                self.records,
                self.scheduler.trace.chrome_events(self.world.rank) if self._trace else None,
                describe_node(self.world.device),
                self.scheduler.policy.detail(),
            ),
            self.world,
        )
        records = sorted(
            (r for rs, *_ in gathered for r in rs), key=lambda r: (r["step"], r["rank"])
        )
        summary = {"name": self.name, **summarize(records, self.world.world_size)}
        summary["hardware"] = {"nodes": nodes_of([node for _, _, node, _ in gathered])}
        summary["optimizations"] = self.scheduler.summary()
        summary["scheduler"] = {
            "policy": self.scheduler.policy.name,
            "order": [opt.name for opt in self.scheduler.optimizations],
            "hooks": self.scheduler.trace.summary(),
            **self.scheduler.policy.stats(),
        }
        details = [detail for *_, detail in gathered]
        if any(d is not None for d in details):
            summary["scheduler"][self.scheduler.policy.name] = details  # one per rank
        if self._grad_sync is not None:
            summary["grad_sync"] = {
                "mode": "flat_allreduce",
                "bytes": self._grad_sync.flat.bytes_per_call,
                "calls": self._grad_sync.flat.calls,
            }
        if self.state.run_dir is not None:
            summary["run_dir"] = str(self.state.run_dir)
        if self._outside_s:
            summary["outside_steps_s"] = dict(self._outside_s)
        if self.notes:
            summary["notes"] = self.notes
        if self.state.eval_results:
            summary["eval"] = {
                "accuracy": self.state.eval_results[-1]["accuracy"],
                "time_s": sum(r["time_s"] for r in self.state.eval_results),
                "runs": self.state.eval_results,
            }
        run_dir = self.state.run_dir
        start = self._start
        resumed_at = start.step if start is not None and start.resumed_from else None
        if (
            run_dir is not None
            and resumed_at is not None
            and not self._steps_this_run
            and (run_dir / "summary.json").is_file()
        ):
            # Run again over a finished run: its results stay (a summary of no steps
            # would replace them).
            self._note(
                f"resumed at step {resumed_at} and trained no step: {run_dir}'s "
                "summary.json and steps.jsonl are the earlier run's, kept"
            )
            run_dir = None
        if run_dir is not None and self.world.is_main:
            trace = (
                [e for _, events, *_ in gathered for e in (events or [])] if self._trace else None
            )
            write_run_files(run_dir, records, summary, trace, resumed_at)
        self.finished = True
        if self._print_summary:
            print_summary(summary)
        self._plain_calls.remove()
        if self._grad_sync is not None:
            self._grad_sync.remove_hooks()
        for sync in self._registered_syncs:
            sync.remove_hooks()
        for hook in self._registered_sync_hooks:
            hook.remove()
        if self._owns_world:
            close_world(self.world)
        return summary


def _sync_left(sync: GradientSync, *hook_args: Any) -> None:
    """Before a registered optimizer's step: sync what no backward's end synced."""
    sync.sync()


def _unsharded(loader: Any) -> str | None:
    """The name of a DataLoader's sampler that hands every rank the whole data set
    (torch's sequential or random sampler), None for any other loader or sampler."""
    sampler = loader.sampler if isinstance(loader, DataLoader) else None
    if type(sampler) in (SequentialSampler, RandomSampler):
        return type(sampler).__name__
    return None
