"""What a script's own loop needs from a `Session`: where a resumed run starts, a
loader whose iteration is the steps, and the step events of the script's own
``model(x)``, ``loss.backward()`` and ``optimizer.step()`` calls."""

from __future__ import annotations

import copy
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from .batch import tensors_in
from .events import Event
from .gradsync import BackwardEnd
from .hooks import SessionHook, _inert_hook  # noqa: F401 - models pickled before name it here

if TYPE_CHECKING:
    from .session import Session

# The steps a prepared model's forwards are watched for state carried between them
# (a loop that carries an RNN's hidden state does from its second step): a few, as
# each look walks the forward's inputs and outputs.
LOOK_STEPS = 4


class LoopWarning(UserWarning):
    """The script's loop is not seen by the session (no steps, so no checkpoints)."""


@dataclass(frozen=True)
class Start:
    """Where the run starts: ``epoch`` and ``batch`` (within that epoch) of the next
    step, ``step`` the steps done; ``resumed_from`` the checkpoint (None: a fresh
    start); ``values`` the plain values given to `Session.start`, as saved."""

    step: int
    epoch: int
    batch: int
    resumed_from: str | None = None
    values: dict[str, Any] = field(default_factory=dict)
    placed: bool = True  # the loader says where it is in its epoch (else batch is 0)

    def describe(self) -> str:
        # A loader with no place of its own (one with a state_dict of its own making,
        # an endless one) goes on where it says: "batch 0" was said of each.
        where = f"batch {self.batch}" if self.placed else "the loader's own place"
        return f"resumed at step {self.step} (epoch {self.epoch}, {where}) from {self.resumed_from}"


class PlainValues:
    """Plain values (numbers, strings, tensors...) checkpointed by name. Each is given
    as a function returning its current value (``best=lambda: best_acc``), read when a
    checkpoint is taken; after a resume the saved values are in `restored`."""

    def __init__(self) -> None:
        self.getters: dict[str, Callable[[], Any]] = {}
        self.restored: dict[str, Any] = {}

    def add(self, name: str, value: Any) -> None:
        self.getters[name] = value if callable(value) else (lambda: value)

    def state_dict(self) -> dict[str, Any]:
        return {name: getter() for name, getter in self.getters.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restored = dict(state)

    def current(self) -> dict[str, Any]:
        return {**self.state_dict(), **self.restored}


class StepLoader:
    """The loader `Session.prepare` returns: iterating it is one epoch of steps
    (`Session.epoch`). Everything else is the prepared loader's."""

    def __init__(self, session: Session, inner: Any) -> None:
        self._session, self.inner = session, inner

    def __iter__(self) -> Iterator[Any]:
        return self._session.epoch(self.inner)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class PlainCalls:
    """Step events for the calls a ported script keeps: ``model(x)`` (forward),
    ``loss.backward()`` (backward starts when it reaches the model's output) and
    ``optimizer.step()`` (gradient sync, the optimizer events, the LR schedule
    passed to `prepare`). Calls made through the session itself fire their events
    there; these hooks stand aside then."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.steps_outside = 0  # optimizer steps taken outside any session step
        self.registered_updates = 0  # steps of registered optimizers (a layer's own)
        self._looked_for_scaler = False
        self._backward_end = BackwardEnd(self._backward_ends, last=True)
        self._handles: list[Any] = []
        # Looked for while checkpointing, until found once (`_look_for_carried_state`).
        self._carried: CarriedState | None = None
        self._timing: Any = None  # the registered model or optimizer timed now
        # The phase the script's forwards and backwards return to: the optimizer's
        # inside its step (LBFGS's closure runs them there, its own work between).
        self.resting = "other"

    @property
    def in_session_call(self) -> bool:
        """Session.forward/backward/forward_backward/optimizer_step is running."""
        return self.session.state.in_session_call

    def install(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        if self.session.checkpointing and self.session.runs_a_script:
            self._carried = CarriedState()
        self._handles.append(
            model.register_forward_pre_hook(SessionHook(self._before_forward), with_kwargs=True)
        )
        self._handles.append(
            model.register_forward_hook(SessionHook(self._after_forward), with_kwargs=True)
        )
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(SessionHook(self._before_step)))
            self._handles.append(optimizer.register_step_post_hook(SessionHook(self._after_step)))

    def watch_update(self, optimizer: torch.optim.Optimizer) -> None:
        """A registered optimizer (a second model's): its step also ends an update, so
        a GAN's step boundary after its generator's step is one a checkpoint resumes at.
        Inside a step it is timed as the optimizer phase."""
        self._handles.append(optimizer.register_step_pre_hook(SessionHook(self._update_starts)))
        self._handles.append(optimizer.register_step_post_hook(SessionHook(self._update_done)))

    def watch_forward(self, module: nn.Module) -> None:
        """A registered model (a GAN's generator, a frozen loss network): its forwards
        inside a step with gradients on are timed as the forward phase, in eval mode
        too (a perceptual loss's VGG, a teacher), and the backward through it from
        when the gradient first reaches one of its outputs (both counted as the
        script's own, ``other``). Only timed: no forward events fire for it."""
        self._handles.append(module.register_forward_pre_hook(SessionHook(self._other_forward)))
        self._handles.append(module.register_forward_hook(SessionHook(self._other_forward_done)))

    def _timed_as(self, phase: str, owner: Any) -> None:
        """Time the registered ``owner``'s call as ``phase``: a script's own call inside
        a step, from the script's own time, or the optimizer's inside a closure (not
        inside another phase: a registered model called within the prepared one's
        forward is that forward's)."""
        clock = self.session.state.clock
        if self._timing is None and self._plain() and clock.current == self.resting:
            clock.switch(phase)
            self._timing = owner

    def step_starts(self) -> None:
        """A registered model's call that raised never said it was done: a new step
        times the next one afresh (and an optimizer step that raised, the same)."""
        self._timing = None
        self.resting = "other"

    def _timed_done(self, owner: Any) -> None:
        if self._timing is owner:
            self._timing = None
            self.session.state.clock.switch(self.resting)

    def _other_forward(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            self._timed_as("forward", module)

    def _other_forward_done(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._timing is not module:
            return
        self._timed_done(module)
        # Backward starts at the first output it reaches: those this forward made (not
        # a parameter or an input it returns, which would gather a hook every step).
        passed = {id(tensor) for tensor in _tensors_with_grad(args)}
        for tensor in _tensors_with_grad(output):
            if tensor.grad_fn is not None and id(tensor) not in passed:
                tensor.register_hook(_OutputReached(self, None))

    def _update_starts(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.session.in_step and not self.in_session_call:
            # Counted: a run whose only updates are registered optimizers' (a loop
            # training each layer by its own) ran no step if its loop bypassed the
            # session, and finish() says so (not at once: a GAN may step once after).
            self.steps_outside += 1
        self._timed_as("optimizer", optimizer)

    def _update_done(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._timed_done(optimizer)
        self.registered_updates += 1
        if self.session.in_step:
            self.session.state.update_pending = False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _plain(self, module: nn.Module | None = None) -> bool:
        """A script's own call, inside a training step (a forward that activation
        checkpointing recomputes during backward is not one)."""
        session = self.session
        if self.in_session_call or not session.in_step or session.paused_now:
            return False
        if session.state.clock.current == "backward":
            return False
        return module is None or (module.training and torch.is_grad_enabled())

    def _training_forward(self, module: nn.Module) -> bool:
        """A training forward inside a step, the script's own call or the session's
        (not while torch.compile traces it: the look would break its graph)."""
        if torch.compiler.is_compiling():
            return False
        session = self.session
        if not session.in_step or session.paused_now:
            return False
        if session.state.clock.current == "backward":
            return False
        return module.training and torch.is_grad_enabled()

    # ----------------------------------------------------------- forward
    def _before_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._carried is not None and self._training_forward(module):
            self._look_for_carried_state((args, kwargs))
        if not self._plain(module):
            return
        self.session.check_plain_forward()
        state = self.session.state
        self.session.training_forward_starts()
        self.session.scheduler.fire(Event.BEFORE_FORWARD, state)
        state.clock.switch("forward")

    def _after_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._carried is not None and self._training_forward(module):
            state = self.session.state
            self._carried.returned(output, state.step, state.batch)
            if self._carried.steps_seen > LOOK_STEPS:  # a loop carries from the start
                self._carried = None
        if not self._plain(module):
            return
        session = self.session
        session.state.clock.switch(self.resting)
        session.scheduler.fire(Event.AFTER_FORWARD, session.state)
        tensor = _first_tensor_with_grad(output)
        if tensor is not None:
            tensor.register_hook(_OutputReached(self, session.state.step))

    def _look_for_carried_state(self, inputs: Any) -> None:
        """Told once: a training forward takes a tensor an earlier step's forward
        returned, and nothing registered for checkpointing holds it."""
        session = self.session
        step = session.state.step
        carried = self._carried.carried(inputs, step)
        if carried is None:
            return
        self._carried = None  # looked for once: not on every forward after it
        if session.holds_storage_of(carried):
            return
        message = (
            f"the model's forward in step {step} takes a tensor that its forward in step "
            f"{step - 1} returned (state carried from batch to batch, as an RNN's hidden "
            "state): no checkpoint holds it, so a resume mid-epoch starts it afresh and "
            "is not exact. Register it, and take it back after a resume: a dict given "
            "to session.start(carry=carry), with carry['hidden'] = hidden after each "
            "batch (restored in place)"
        )
        session.notes.append(f"cannot resume exactly: {message}")
        warn(message)

    def _backward_reaches_output(self, forward_step: int | None) -> None:
        """``forward_step``: the prepared model's forward's step (a registered model's
        outputs say nothing of the loop's order: None)."""
        session = self.session
        if session.in_step and forward_step is not None and session.state.step != forward_step:
            session.warn_fetch_ahead(forward_step)
        if session.in_step and not self.in_session_call and not self._backward_end.armed_now():
            session.scheduler.fire(Event.BEFORE_BACKWARD, session.state)
            session.state.clock.switch("backward")
            # Once per pass, whatever the outputs; on a GPU on an autograd thread: the
            # handlers of AFTER_BACKWARD keep no per-thread state.
            self._backward_end.arm()

    def _backward_ends(self) -> None:
        """The script's ``loss.backward()`` is done: its gradients are averaged
        across ranks before it returns, so clipping them sees them synced (the flat
        all-reduce's own hooks also sync when the output was not reached)."""
        session = self.session
        if session.state.clock.current == "backward":
            session.state.clock.switch(self.resting)
            session.scheduler.fire(Event.AFTER_BACKWARD, session.state)
        session.backward_ended()

    # --------------------------------------------------------- optimizer
    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        session = self.session
        if self.in_session_call:
            return
        if not session.in_step:
            self.steps_outside += 1
            if self.steps_outside == 1:
                session.warn_loop_unseen()
            return
        session.check_plain_step()
        if not self._looked_for_scaler:  # once: the first step it did not skip
            self._looked_for_scaler = True
            session.check_script_scaler(_calling_scaler())
        if session.state.clock.current == "backward":
            session.state.clock.switch("other")
            session.scheduler.fire(Event.AFTER_BACKWARD, session.state)
        session.before_optimizer_step()
        self.resting = "optimizer"

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.in_session_call or not self.session.in_step:
            return
        self.resting = "other"
        self.session.after_optimizer_step()


class CarriedState:
    """The storages of the tensors a step's training forwards returned, held weakly,
    to tell a loop that feeds one of them to a later step's forward (an RNN's hidden
    state, detached from its graph: a new tensor over the same storage)."""

    def __init__(self) -> None:
        self._step = -1
        self._returned: set[StorageWeakRef] = set()  # by this step's forwards
        self._before: set[StorageWeakRef] = set()  # by the step before
        self.steps_seen = 0

    def _at(self, step: int) -> None:
        if step != self._step:
            self._before = self._returned if step == self._step + 1 else set()
            self._returned, self._step = set(), step
            self.steps_seen += 1

    def returned(self, output: Any, step: int, batch: Any) -> None:
        """What a forward returned, but for views of the step's ``batch`` (a model
        returning its input, as a VAE's ``[recon, input, mu, logvar]``: the next batch
        may be another view of one tensor of batches, or the same batch again). A state
        the model updates in place and returns still counts."""
        self._at(step)
        self._returned.update(set(_storages(output)) - set(_storages(batch)))

    def carried(self, inputs: Any, step: int) -> list[torch.Tensor] | None:
        """The inputs over a storage the step before returned, None if none. A weak
        reference keeps its storage's record alive (not its data): no other storage
        takes its address while it is held, so an equal one is that very storage."""
        self._at(step)
        if not self._before:
            return None
        found = [
            tensor
            for tensor in tensors_in(inputs)
            if (ref := _storage_ref(tensor)) is not None and ref in self._before
        ]
        return found or None


def _storage_ref(tensor: torch.Tensor) -> StorageWeakRef | None:
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, and other storage-less layouts
        return None
    return StorageWeakRef(storage) if storage.nbytes() else None


def _storages(value: Any) -> Iterator[StorageWeakRef]:
    for tensor in tensors_in(value):
        if (ref := _storage_ref(tensor)) is not None:
            yield ref


class _OutputReached:
    """The hook on a training forward's output: backward has reached it. It holds the
    session's `PlainCalls` weakly. The autograd graph it sits in is C++, where the
    garbage collector cannot see: a strong hold kept the session, and through a value
    registered as ``lambda: value`` the script's module globals, alive past the
    interpreter's exit while the script kept its last ``loss`` (a log file it never
    closed was never flushed, and came out empty)."""

    def __init__(self, calls: PlainCalls, forward_step: int | None) -> None:
        self._calls = weakref.ref(calls)
        self._forward_step = forward_step

    def __call__(self, grad: torch.Tensor) -> None:
        calls = self._calls()
        if calls is not None:
            calls._backward_reaches_output(self._forward_step)


class PreparedSchedule:
    """Steps the LR schedule given to `Session.prepare` after each optimizer step. A
    port that kept the script's own ``scheduler.step()`` would step it twice per
    update: before the next optimizer step every step the session took is undone
    (the schedule and the learning rates as before its first), the script's are
    replayed, a `LoopWarning` says so, and from then on the script steps it alone.
    A schedule that is not torch's `LRScheduler` (no ``last_epoch``) is only stepped."""

    def __init__(self, schedule: Any, optimizer: torch.optim.Optimizer) -> None:
        self.schedule, self.optimizer = schedule, optimizer
        self.by_session = True
        self._watched = isinstance(schedule, torch.optim.lr_scheduler.LRScheduler)
        self._start: tuple[dict[str, Any], list[Any], int] | None = None
        self._session_steps = 0

    def step(self) -> None:
        if not self.by_session:
            return
        if self._watched and self._start is None:
            try:  # once: where the schedule was before the session's first step
                saved = copy.deepcopy(self.schedule.state_dict())
            except Exception:  # noqa: BLE001 - state that cannot be copied: not watched
                self._watched = False
            else:
                lrs = [group["lr"] for group in self.optimizer.param_groups]
                self._start = (saved, lrs, self.schedule.last_epoch)
        self.schedule.step()
        self._session_steps += 1

    def check(self) -> None:
        """Before an optimizer step: did the script step the schedule too?"""
        if self._start is None or not self.by_session:
            return
        saved, lrs, first = self._start
        script_steps = self.schedule.last_epoch - first - self._session_steps
        if script_steps <= 0:
            return
        self.schedule.load_state_dict(saved)
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        for _ in range(script_steps):
            self.schedule.step()
        self.by_session = False
        steps = self._session_steps
        # The first update ran before any step; each later one after a session step
        # the script had not taken then (it takes one now: one per update, none missed).
        differed = steps - 1 if script_steps < steps else 0
        already = (
            f"; but {differed} update(s) before this one used rates the session's steps "
            "set, not the script's, so the run differs from the script's"
            if differed
            else ""
        )
        warn(
            f"the script steps the LR schedule it gave to session.prepare(), which steps it "
            f"after every optimizer step too: the session's {steps} step(s) were undone "
            f"and the script's own scheduler.step() steps it from now on{already} (pass the "
            "schedule to prepare() or step it in the script, not both)"
        )


def _calling_scaler() -> torch.amp.GradScaler | None:
    """The script's GradScaler whose ``scaler.step(optimizer)`` called this optimizer
    step, if one did (its frame is a few levels up: torch's step wrappers between)."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.amp.GradScaler):
            return owner
        frame = frame.f_back
    return None


def _first_tensor_with_grad(output: Any) -> torch.Tensor | None:
    return next(_tensors_with_grad(output), None)


def _tensors_with_grad(output: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``output`` (a tensor, or mappings, lists and tuples of them,
    named tuples too) that gradients will reach."""
    return (tensor for tensor in tensors_in(output) if tensor.requires_grad)


def note(message: str) -> None:
    """One line for the person running the script (stderr, main rank by the caller)."""
    print(f"overlapkit: {message}", file=sys.stderr, flush=True)


def warn(message: str) -> None:
    """A `LoopWarning` pointing at the script's line (the first frame outside
    overlapkit and torch: some come from inside autograd's hooks)."""
    frame, level = _script_frame()
    warnings.warn(message, LoopWarning, stacklevel=level if frame is not None else 2)


def script_variables() -> tuple[Any, dict[str, Any]]:
    """The script's function now calling into overlapkit (its code object: None if
    none) and its variables."""
    frame, _ = _script_frame()
    return (frame.f_code, dict(frame.f_locals)) if frame is not None else (None, {})


def _script_frame() -> tuple[Any, int]:
    """The first frame outside overlapkit and torch, and its stack level for
    `warnings.warn` called from this module's caller."""
    inside = (str(Path(__file__).parents[1]), str(Path(torch.__file__).parent))
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return frame, level
