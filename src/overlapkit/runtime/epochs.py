"""The `Session`'s side for a script's own epoch loop: where the run starts, one epoch
of steps from the script's loader, time the script pauses, and what a script is told
when the session cannot see its loop. (A part of `Session`; see `session`.)"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from time import perf_counter
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from ..data import (
    SEQUENCES,
    ScriptLoader,
    SequenceLoader,
    iterated_note,
    resume_problem,
    sampler_note,
)
from .optimization import Optimization
from .rng import capture_rng, same_host_rng
from .script import Start, StepLoader, note, warn

if TYPE_CHECKING:
    pass

_END = object()


# Why a loader yields nothing when it is its own iterator.
USED_UP = (
    ": it is an iterator (a generator?), used up after one pass; pass something that "
    "can be iterated again (a DataLoader, a list)"
)


def _original_of(prepared: Any) -> Any:
    """What the script gave `prepare`, under the loaders wrapped around it (prefetch's
    around a `ScriptLoader`, say); None when it gave none of those."""
    while prepared is not None:
        if (original := getattr(prepared, "original", None)) is not None:
            return original
        prepared = getattr(prepared, "inner", None)
    return None


def _handed_out(loader: Any) -> bool:
    """A loader with a position and a length has handed out its whole epoch."""
    position = getattr(loader, "position", None)
    if position is None:
        return False
    try:
        return 0 < len(loader) <= position
    except Exception:  # noqa: BLE001 - no length, or one its sampler cannot give
        return False


class EpochLoop:
    """`Session` methods for epoch loops (mixed into `Session`)."""

    def _drop_single_process_noops(
        self, optimizations: Sequence[Optimization]
    ) -> list[Optimization]:
        """One process has nothing to overlap its gradients with: such an optimization
        is left out, with a note, so one script runs alone and under torchrun."""
        kept = []
        for opt in optimizations:
            if getattr(opt, "noop_alone", False) and self.world.world_size == 1:
                self._note(f"{opt.name} is off: one process has no gradients to exchange")
            else:
                kept.append(opt)
        return kept

    def _note(self, message: str) -> None:
        self.notes.append(message)
        if self.world.is_main:
            note(message)

    def _unwrapped(self, model: nn.Module) -> nn.Module:
        if isinstance(model, DistributedDataParallel):
            self._note(
                "the model came wrapped in DistributedDataParallel: unwrapped; gradients are "
                "synced by overlapkit (ddp_overlap, or one flat all-reduce)"
            )
            return model.module
        if isinstance(model, nn.DataParallel):
            # Left wrapped, on GPUs it would copy the model to every GPU the process sees
            # (other ranks' too), and fail at the forward of a rank whose device is not
            # GPU 0 (DataParallel wants its module on device_ids[0]).
            self._note(
                "the model came wrapped in DataParallel: unwrapped; overlapkit trains it on "
                "this process's device: for several GPUs, start one rank per GPU (torchrun "
                "--nproc-per-node N), which overlapkit makes data-parallel as DDP does"
            )
            return model.module
        return model

    @property
    def checkpoint(self) -> Optimization | None:
        """The checkpoint optimization of this session, if it has one."""
        return next((o for o in self.scheduler.optimizations if o.name == "checkpoint"), None)

    @property
    def checkpointing(self) -> bool:
        return self.checkpoint is not None

    def _resumable(self, loader: Any) -> Any:
        if loader is None:
            return None
        if isinstance(loader, SEQUENCES):  # the same items every epoch: a position is all
            return SequenceLoader(loader)
        problem = resume_problem(loader)
        if problem is None and isinstance(loader, DataLoader):
            if self.checkpointing and (hint := sampler_note(loader)):
                self._note(hint)
            if self.runs_a_script and (iterated := iterated_note(loader)):
                self.notes.append(iterated)
                warn(iterated)
            return ScriptLoader(loader)
        if problem is not None and self.checkpointing:
            self._note(f"cannot resume exactly: {problem}")
        return loader

    def start(self, **state: Any) -> Start:
        """Start the run now: resume from the newest checkpoint if there is one (and
        say so), and return where the run starts (`Start`: epoch, batch, step).

        Call it before the script's epoch loop: ``for epoch in range(start.epoch,
        epochs)``. Keyword arguments are registered for checkpointing first (see
        `register_for_checkpointing`): ``start(scheduler=scheduler, best=lambda:
        best_acc)``; ``start.values["best"]`` is then the saved value after a resume,
        the current one otherwise. Calling it again returns the same `Start`."""
        for name, obj in state.items():
            self.register_for_checkpointing(name, obj)
        self._fit_start(None)
        return self._start

    def epoch(self, loader: Any = None) -> Iterator[Any]:
        """Yield the rest of the loader's current epoch (all of it, unless a resume
        stopped mid-way), one step per batch: the step events fire, its phases are
        timed. A ``break`` closes the step. Iterating the loader `prepare` returned
        does the same."""
        loader = self._unwrap_loader(loader)
        if self.state.accumulate > 1:
            raise ValueError(
                "Session(accumulate=k) runs with session.steps(n); in an epoch loop, "
                "accumulate in the script"
            )
        self._fit_start(None)
        if self._left_pass:
            self._next_epoch(loader)
        state = self.state
        iterator: Iterator[Any] | None = None
        self._epoch_batches = 0
        try:
            while True:
                # A loader that has handed out its whole epoch ends it with no step begun:
                # a checkpoint due now is taken at the next step's start, after the
                # script's end-of-epoch code (its evaluation, an lr annealed by hand).
                # Before the loader loads (a dataset drawing in __getitem__, no workers:
                # those draws are where they were in the run never stopped).
                self._check_draws_before_resumed_batch(loader)
                over = _handed_out(loader)
                if not over:
                    self.start_step()
                    state.micro_step = 0
                with state.clock.phase("data_wait") if not over else nullcontext():
                    if iterator is None:
                        iterator = iter(loader)
                    batch = next(iterator, _END)
                if over and batch is not _END:  # more batches than its length said
                    loader.position -= 1  # a checkpoint now is of the step before it
                    self.start_step()
                    loader.position += 1
                    state.micro_step = 0
                self._say_inexact(loader)
                if batch is _END:
                    self._end_of_epoch()
                    if self._epoch_batches == 0 and iterator is loader:
                        raise RuntimeError(f"the loader yielded no batch this epoch{USED_UP}")
                    self._epoch += 1  # (a loader with a position moved on by itself)
                    self._epoch_batches = 0
                    self._batches_before_resume = 0
                    return
                self._epoch_batches += 1
                self._check_restarted_epoch(loader)
                updates = self._updates_so_far
                yield self._arrived(batch)
                if self._resumed_mid_epoch is not None:
                    self._check_resumed_sampler_epoch(loader)
                    self._check_first_resumed_batch(updates)
                if self._in_step:
                    self.end_step()
        except GeneratorExit:
            peeked = (
                self._epoch_batches == 1
                and self._updates_so_far == updates
                and not state.update_pending
                and self._forwards_in_step == 0  # (a script updating by hand trained it)
            )
            if peeked:
                # One batch looked at, nothing trained (``next(iter(loader))`` for a
                # shape): as if not taken, the loader goes on where it was (a list
                # starts again anyway), and no epoch is counted, nor a step (a script
                # looking every epoch counted one more step than updates per epoch).
                if getattr(loader, "position", 0) > 0:
                    loader.position -= 1
                self._in_step = False
                self.state.clock.pause()
            else:
                # A break in the script's loop: a next pass over the loader is a new
                # epoch, as over the script's own DataLoader (not the rest of this one).
                self._left_pass = True
            raise
        finally:
            if self._step_to_end:  # the step a break (or an error) left
                self.end_step()

    def _watch_resumed_batch(self, start: Start) -> None:
        """A resume mid-epoch: what the script does before its first batch (its draws)
        and with it is checked."""
        self._resumed_mid_epoch = (start.epoch, start.batch) if start.batch > 0 else None
        self._rng_at_resume = capture_rng() if self._resumed_mid_epoch else None

    def _check_draws_before_resumed_batch(self, loader: Any) -> None:
        """The first batch after a resume mid-epoch arrives: the script drew from
        Python's random or NumPy since the resume, at the top of its epoch loop (a
        shuffle of the epoch's minibatches, as the char-RNN tutorial makes them). In
        the run never stopped those draws came before the checkpoint, from another
        state: the rest of the epoch was other minibatches, silently. (Torch's RNG is
        not looked at: a DataLoader's iterator draws its seed from it there too.)"""
        saved, self._rng_at_resume = self._rng_at_resume, None
        if saved is None or hasattr(loader, "inner"):
            return  # (under prefetch its feeder thread has been loading meanwhile)
        if same_host_rng(capture_rng(), saved):
            return
        epoch, batch = self._resumed_mid_epoch or (self._epoch, 0)
        message = (
            f"the script drew from Python's random or NumPy after the resume and before "
            f"batch {batch} of epoch {epoch} was asked for (a shuffle of the epoch's batches at the "
            "top of its epoch loop?): in the run never stopped those draws came before "
            "the checkpoint, from another state, so the rest of this epoch is drawn "
            "otherwise (unless the script seeds them itself). Register what they made, "
            "session.start(batches=lambda: batches), and take it back from start.values"
        )
        self.notes.append(f"cannot resume exactly: {message}")
        warn(message)

    def _check_first_resumed_batch(self, updates: int) -> None:
        """The first batch after a resume mid-epoch is done: a script that went past it
        without training skips, by hand, the batches the loader already skipped."""
        (epoch, batch), self._resumed_mid_epoch = self._resumed_mid_epoch, None
        if self._forwards_in_step or self._updates_so_far != updates:
            return
        message = (
            f"the first batch after the resume (epoch {epoch}, batch {batch}) "
            "went by with no training forward: the loader already goes on at that batch, so "
            "a script skipping the batches trained before the checkpoint (`if step < "
            "resume_step: continue`, accelerate's skip_first_batches) skips them twice. Drop "
            "the skip; count batches from start.batch: enumerate(loader, start.batch). Or "
            "the script trains only once state of its own fills up again (a replay memory "
            "left out of session.start(), started empty): register it"
        )
        self.notes.append(message)
        warn(message)

    def _check_resumed_sampler_epoch(self, loader: Any) -> None:
        """The first batch after a resume mid-epoch is done: the script set its sampler
        to the epoch it had in that pass when the checkpoint was taken (or left it). A
        script still resuming from its own checkpoint file too (its epoch loop starting
        at that file's epoch, not start.epoch) set another one, silently."""
        inner = getattr(loader, "inner", loader)  # under prefetch, the script's loader
        saved = getattr(inner, "resumed_sampler_epoch", None)
        if saved is None:
            return
        inner.resumed_sampler_epoch = None
        now = getattr(inner.sampler, "epoch", saved)
        if now == saved:
            return
        message = (
            f"the script set its sampler's epoch to {now} (sampler.set_epoch) for the pass "
            f"the resume goes on with, which it had set to {saved} when the checkpoint was "
            "taken: the rest of that epoch comes in another order, and the script counts "
            "its epochs otherwise than the run did (it trains epochs again, or skips some). "
            "Does it still resume from its own checkpoint file too? Keep one resume: start "
            "the epoch loop at start.epoch"
        )
        self.notes.append(f"cannot resume exactly: {message}")
        warn(message)

    def _check_restarted_epoch(self, loader: Any) -> None:
        """After a resume mid-epoch, a loader with no position of its own (a state_dict
        the session saves, but not its place in the epoch) that hands out more batches
        than the epoch had left started its epoch again: the batches trained before the
        checkpoint are trained twice (airbench's CifarLoader given a state_dict)."""
        before = self._batches_before_resume
        if not before or getattr(loader, "position", None) is not None:
            return
        if isinstance(loader, SEQUENCES):  # not prepared: session.epoch(batches)
            self._batches_before_resume = 0
            message = (
                f"the checkpoint was taken after batch {before} of epoch {self._epoch}, and "
                f"the script's {type(loader).__name__} of batches, given to session.epoch() "
                "but not to prepare(), has no place in the epoch: it starts again at its "
                f"first batch, so the {before} batches before the checkpoint are trained "
                "twice. Give prepare() what has the same batches every epoch (a list, or "
                "range(n_batches) to index the epoch's own list by)"
            )
            self.notes.append(f"cannot resume exactly: {message}")
            warn(message)
            return
        if not hasattr(loader, "state_dict"):
            return  # told at prepare: it restarts its epoch after a resume
        try:
            size = len(loader)
        except Exception:  # noqa: BLE001 - an iterable of unknown length
            return
        if before + self._epoch_batches <= size:
            return
        self._batches_before_resume = 0
        message = (
            f"the checkpoint was taken after batch {before} of epoch {self._epoch}, and the "
            f"loader ({type(loader).__name__}) has handed out {self._epoch_batches} batches "
            f"of it since the resume, more than the {size - before} left: it started the "
            "epoch again (its state_dict does not hold its place in the epoch), so those "
            f"{before} batches are trained twice. Save the loader's position in its "
            "state_dict, or pass a map-style torch DataLoader"
        )
        self.notes.append(f"cannot resume exactly: {message}")
        warn(message)

    def _next_epoch(self, loader: Any) -> None:
        """A pass the script left (a ``break``) is over: the loader moves on to the
        next epoch, freshly drawn."""
        self._left_pass = False
        self._epoch += 1
        self._epoch_batches = 0
        self._batches_before_resume = 0
        if hasattr(loader, "next_epoch"):
            loader.next_epoch()
        self._say_inexact(loader)

    def _say_inexact(self, loader: Any) -> None:
        """Once, when checkpointing: why the loader cannot resume exactly, as it found."""
        said = getattr(loader, "inexact_resume", None)
        if said and self.checkpointing and said not in self.notes:
            self._note(said)

    def progress(self) -> dict[str, Any]:
        """Where a run resumed from a checkpoint taken now goes on: its step, and its
        epoch, the next one when this one's batches were all trained (a loader with no
        position of its own, an iterable the script made, can only restart an epoch;
        a loader with one says where it is itself, see `_where`). A pass
        the script left (a ``break``) is resumed where it was left: whether the run
        would have gone on to the next epoch or stopped there (a break to save and
        stop, an error), nothing says."""
        try:
            size = len(self.state.loader)
        except Exception:  # noqa: BLE001 - an iterable of unknown length
            size = None
        whole = size is not None and 0 < size <= self._epoch_batches
        if whole:
            return {"step": self.state.step, "epoch": self._epoch + 1, "batch": 0}
        batch = self._batches_before_resume + self._epoch_batches
        return {"step": self.state.step, "epoch": self._epoch, "batch": batch}

    def resume_progress(self, progress: dict[str, Any]) -> None:
        self.state.step = progress["step"]
        self._epoch = progress["epoch"]
        self._batches_before_resume = int(progress.get("batch", 0))

    def _end_of_epoch(self) -> None:
        """The step begun for a batch the epoch did not have: nothing ran in it. What
        follows (the script's evaluation, its LR schedule...) is outside every step."""
        self._in_step = False
        self.state.clock.pause()
        self._gap_since = perf_counter()
        self._labelled_in_gap = 0.0

    @contextmanager
    def paused(self, label: str = "evaluation") -> Iterator[None]:
        """Leave the time inside out of every step (the script's own evaluation, a
        save...) and report it in the summary under ``outside_steps_s[label]``. A
        pause inside another counts under its own label only (the outer one's
        figure is its time outside the inner ones): the labels add up."""
        start = perf_counter()
        outermost = self._paused == 0
        self._paused += 1
        self._nested_s.append(0.0)  # the time of the pauses inside this one
        clock = self.state.clock
        previous = clock.switch("paused") if self._in_step and outermost else None
        try:
            yield
        finally:
            self._paused -= 1
            seconds = perf_counter() - start
            self._outside_s[label] += seconds - self._nested_s.pop()
            if self._nested_s:
                self._nested_s[-1] += seconds
            elif previous is not None:
                clock.switch(previous)
            else:
                clock.pause()
                if self._gap_since is not None:
                    self._labelled_in_gap += seconds

    @property
    def _updates_so_far(self) -> int:
        """Optimizer steps, the registered optimizers' too: a loop training each layer
        with its own (forward-forward) trains a batch with none of the prepared one's."""
        return self._optimizer_steps + self._plain_calls.registered_updates

    @property
    def paused_now(self) -> bool:
        return self._paused > 0

    @property
    def in_step(self) -> bool:
        return self._in_step

    @property
    def _step_to_end(self) -> bool:
        """A step is open and its end has not failed already (a STEP_END hook that
        raised: the error is raised once, the step not ended again)."""
        return self._in_step and not self._end_failed

    def _unwrap_loader(self, loader: Any) -> Any:
        """The prepared loader for ``loader``: the one `prepare` returned, or the one it
        was given (the script's own DataLoader or list, iterated through the session:
        its position is the prepared one's)."""
        prepared = self.state.loader
        if loader is None or loader is _original_of(prepared):
            return prepared
        return loader.inner if isinstance(loader, StepLoader) else loader

    def _where(self) -> Start:
        loader = self.state.loader
        position = getattr(loader, "position", None)
        epoch = getattr(loader, "epoch", None) if position is not None else None
        return Start(
            step=self.state.step,
            epoch=self._epoch if epoch is None else int(epoch),
            batch=int(position or 0),
            resumed_from=self.state.resumed_from,
            values=self._values.current(),
            # (no loader prepared: a list given to epoch() starts its pass again)
            placed=loader is not None
            and (position is not None or not hasattr(loader, "state_dict")),
        )

    def check_plain_step(self) -> None:
        """A script's own ``optimizer.step()`` inside a step: what it cannot do."""
        if self.precision.scaler is not None:
            raise RuntimeError(
                "under fp16 call session.backward(loss) and session.optimizer_step(): a plain "
                "loss.backward() and optimizer.step() skip the loss scaling"
            )
        if self.state.accumulate > 1:
            raise RuntimeError(
                "with Session(accumulate=k) call session.backward(loss) and "
                "session.optimizer_step(), which accumulate k micro-batches per step"
            )
        if self.scheduler.provider("forward_backward") is not None:
            raise RuntimeError(
                "under pipeline call session.forward_backward(inputs, targets, loss_fn) and "
                "session.optimizer_step(): each rank holds only some layers"
            )

    def check_plain_forward(self) -> None:
        """A script's own ``model(x)`` inside a step: autocast needs `forward` (under
        pipeline, the stage refuses it itself: see `Pipeline._only_in_schedule`)."""
        if self.precision.name != "fp32":
            raise RuntimeError(
                f"precision {self.precision.name}: run the forward pass inside "
                "`with session.forward():`, which autocasts"
            )

    def warn_fetch_ahead(self, forward_step: int) -> None:
        """The script's backward in this step is of an earlier step's forward: it
        fetches its next batch (the next step) before it updates."""
        told, self.state.fetches_ahead = self.state.fetches_ahead, True
        if told or not self.checkpointing:
            return
        warn(
            f"loss.backward() in step {self.state.step} is of the forward of step "
            f"{forward_step}: the loop fetches its next batch before it updates, so no step "
            "boundary falls after an update, and a checkpoint there could not resume "
            "exactly; none is taken until one does. Fetch each batch at the top of the "
            "loop (or use session.steps(n))"
        )

    def check_script_scaler(self, scaler: Any) -> None:
        """The script steps through its own GradScaler: unless it was registered, its
        loss scale and growth tracker are not in the checkpoints."""
        if scaler is None or not self.checkpointing or not scaler.is_enabled():
            return
        if self.holds(scaler):
            return
        message = (
            "the script's GradScaler is not checkpointed: a resumed run starts from its "
            "initial loss scale, not the saved one. Register it: session.start(scaler=scaler)"
        )
        self.notes.append(f"cannot resume exactly: {message}")
        warn(message)

    def warn_loop_unseen(self) -> None:
        saving = " and no checkpoint is taken" if self.checkpointing else ""
        warn(
            "optimizer.step() ran outside any step of the session: the summary counts no "
            f"steps{saving}. Iterate the loader session.prepare() returned (or "
            "session.epoch(loader), session.steps(n))"
        )

    def _warn_if_no_steps(self) -> None:
        # Told when the script's loop bypassed the session: optimizer steps outside it,
        # or checkpointing with a loop that never started (not a resumed, finished run).
        unseen = self._plain_calls.steps_outside or (self.checkpointing and not self._started)
        if self._steps_this_run or not unseen:
            return
        warn(
            "no step ran through the session"
            + (", so no checkpoint was taken" if self.checkpointing else "")
            + f" ({self._plain_calls.steps_outside} optimizer steps outside it). Iterate the "
            "loader session.prepare() returned (or session.epoch(loader), session.steps(n))"
        )
