"""The gradient synchronisation every multi-rank run needs when no optimization provides one.

All gradients are all-reduced once, as one flat buffer, after the backward
pass: nothing overlaps, so the whole all-reduce is exposed. This is also the
baseline that ``ddp_overlap`` is measured against.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .hooks import SessionHook
from .optimization import COMM_WAIT
from .state import temporarily

if TYPE_CHECKING:
    from .state import State


def broadcast_model(model: nn.Module, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Start every rank (of ``group``) from global rank ``src``'s parameters and buffers."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src, group=group)


class BackwardEnd:
    """Calls ``callback`` once the backward pass now running ends, before its
    ``backward()`` returns, however many times `arm` is called during the pass (as
    DDP's reducer queues its end-of-backward work). A pass that raised never calls
    it; the next pass arms afresh (passes are told apart by autograd's task id).
    A backward run inside another's node (reentrant activation checkpointing runs
    one per checkpointed segment) is not the end: its end arms the pass around it,
    once that node is done, so the callback runs once, when the outermost ends.
    On a GPU the callback runs on the autograd thread that finishes the pass.
    ``last``: after the end-of-backward work queued behind it too (DDP's reducer
    queues its wait for the buckets' all-reduces once the last bucket is launched:
    the wait is backward's, not what runs after it)."""

    def __init__(self, callback: Callable[[], None], last: bool = False) -> None:
        self._callback = callback
        self._last = last
        self._armed_in: set[int] = set()  # the passes (tasks) it is queued in

    def arm(self) -> None:
        task = torch._C._current_graph_task_id()
        if task not in self._armed_in:
            self._armed_in.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(self._ended)

    def armed_now(self) -> bool:
        """Armed in the backward pass now running (none: False)."""
        return torch._C._current_graph_task_id() in self._armed_in

    def _ended(self) -> None:
        self._armed_in.discard(torch._C._current_graph_task_id())
        around = torch._C._current_autograd_node()  # the node that ran this pass, if any
        if around is not None:
            around.register_hook(self._around_done)
        elif self._last:  # queued again: after every callback queued since
            torch.autograd.Variable._execution_engine.queue_callback(self._run)
        else:
            self._run()

    def _around_done(self, *grads: Any) -> None:
        self.arm()  # in the pass around, now current

    def _run(self) -> None:
        self._armed_in.clear()  # and any a pass that raised left
        self._callback()


class FlatAllReduce:
    """Averages gradients across ranks with one all-reduce of one flat buffer; the
    module's buffers (batch-norm statistics) become rank ``src``'s at the next forward,
    as DDP's do (every rank evaluates with rank 0's statistics). They are broadcast
    with the sync at the end of a synced backward (``__call__(buffers=True)``) and
    copied in by a hook before the next forward, so no forward is a collective (an
    evaluation on rank 0 alone cannot hang its peers), and what the script reads in
    between is this rank's own, as under DDP (an EMA of the buffers updated after the
    optimizer step, torchvision's: it took rank 0's on the other ranks). Not so under
    ``at_next_forward=False`` (a pipeline's stages: its schedule calls them one by one,
    not the module list a hook would sit on, and torch's set-up forward puts each
    stage's own buffers back): they are copied in with the sync.

    The gradients live in that buffer as views, so nothing is copied before or
    after the all-reduce, provided they are zeroed in place rather than set to
    None (``State.zero_grad_in_place``): otherwise the first call after each
    ``zero_grad(set_to_none=True)`` copies them back in.

    As DDP's reducer does, a hook on each parameter's gradient accumulation notes
    that gradients changed (`dirty`) and has ``on_backward_end`` called once the
    backward pass that changed them ends, whatever the model's outputs, the loss or
    the caller (a script's own ``loss.backward()``, a backward of part of the model).
    """

    def __init__(
        self,
        model: nn.Module,
        world_size: int,
        group: dist.ProcessGroup | None,
        on_backward_end: Callable[[], None],
        src: int = 0,
        at_next_forward: bool = True,
    ) -> None:
        self.group, self.src = group, src
        self.at_next_forward = at_next_forward
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = list(model.buffers())
        self.world_size = world_size
        tensors = self.params
        dtype = tensors[0].dtype if tensors else torch.float32
        self.flat = torch.zeros(
            sum(t.numel() for t in tensors), dtype=dtype, device=_device(tensors)
        )
        self.bytes_per_call = self.flat.numel() * self.flat.element_size()
        self.calls = 0
        self._views: list[torch.Tensor] = []
        offset = 0
        for tensor in tensors:
            self._views.append(self.flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
        with torch.no_grad():
            for param, view in zip(self.params, self._views, strict=False):
                param.grad = view  # gradients accumulate straight into the flat buffer
        self.dirty = False  # gradients accumulated since the last all-reduce
        self._end = BackwardEnd(on_backward_end)
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulated) for p in self.params]
        # Rank src's buffers as broadcast, per dtype, until the next forward takes them.
        self._broadcast: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        if at_next_forward:
            self._hooks.append(model.register_forward_pre_hook(SessionHook(self._take_buffers)))
            # Buffers loaded since (a resume, the script's own load_state_dict) stay.
            self._hooks.append(model.register_load_state_dict_post_hook(SessionHook(self._forget)))

    def _accumulated(self, param: torch.Tensor) -> None:
        self.dirty = True
        self._end.arm()

    def remove_hooks(self) -> None:
        self._take_buffers()  # the run ends: its next forward would have
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    @torch.no_grad()
    def __call__(self, buffers: bool = False) -> None:
        """All-reduce the gradients; ``buffers``: and take rank ``src``'s buffers (at
        the end of a synced backward: DDP would before the next forward)."""
        if buffers and self.buffers:
            self.broadcast_buffers()
        for param, view in zip(self.params, self._views, strict=True):
            if param.grad is None:
                view.zero_()
                param.grad = view
            elif param.grad.data_ptr() != view.data_ptr():
                view.copy_(param.grad)
                param.grad = view
        dist.all_reduce(self.flat, group=self.group)
        self.calls += 1
        self.dirty = False
        self.flat /= self.world_size

    @torch.no_grad()
    def broadcast_buffers(self) -> None:
        """Broadcast rank ``src``'s buffers (one broadcast per dtype); the other ranks
        take them at their next forward."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for buffer in self.buffers:
            by_dtype.setdefault(buffer.dtype, []).append(buffer)
        self._broadcast = []
        for buffers in by_dtype.values():
            flat = _flatten_dense_tensors(buffers)
            dist.broadcast(flat, self.src, group=self.group)
            if dist.get_rank() != self.src:
                self._broadcast.append((buffers, flat))
        if not self.at_next_forward:
            self._take_buffers()

    @torch.no_grad()
    def _take_buffers(self, *hook_args: Any) -> None:
        broadcast, self._broadcast = self._broadcast, []
        for buffers, flat in broadcast:
            for buffer, value in zip(buffers, _unflatten_dense_tensors(flat, buffers), strict=True):
                buffer.copy_(value)

    def _forget(self, *hook_args: Any) -> None:
        self._broadcast = []


class GradientSync:
    """The flat all-reduce as a run drives it, the same for the session's own sync and
    ``ddp_overlap``'s no-overlap baseline: every rank starts from rank ``src``'s model;
    a backward pass that changed the gradients syncs them when it ends (the script's
    own at once, one inside a session call when the call returns: `backward_ended`),
    unless the step accumulates micro-batches or the script said ``no_sync``; the
    optimizer step syncs whatever is left (`sync`). ``around``: a context entered
    around each all-reduce (``ddp_overlap`` times it)."""

    def __init__(
        self,
        model: nn.Module,
        state: State,
        around: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> None:
        dp = state.dp
        broadcast_model(model, dp.src, dp.group)
        self.state, self._around = state, around
        # A script calls its model; a pipeline's schedule calls its stages (see
        # `FlatAllReduce`: their buffers are copied in with the sync).
        self.flat = FlatAllReduce(
            model,
            dp.size,
            dp.group,
            self._hooked_end,
            src=dp.src,
            at_next_forward=state.data_parallel is None,
        )
        state.zero_grad_in_place = True

    def _hooked_end(self) -> None:
        """A backward pass that changed the gradients ended: the script's own (sync
        now), or one inside a session call, which syncs once when it returns (a
        pipeline's schedule runs a backward per micro-batch)."""
        if not self.state.in_session_call:
            self.backward_ended()

    def backward_ended(self) -> None:
        """A backward ended: sync, with rank ``src``'s buffers (as DDP), if wanted."""
        if self.state.sync_wanted:
            self.sync(buffers=True)

    def sync(self, buffers: bool = False) -> None:
        """All-reduce the gradients if they changed since the last sync (as exposed
        communication, critical for the arbitration policy)."""
        if not self.flat.dirty:
            return
        state = self.state
        with self._around(), state.clock.phase("comm_exposed"), state.policy.critical(*COMM_WAIT):
            self.flat(buffers=buffers)

    def remove_hooks(self) -> None:
        """The model outlives the run: no all-reduce after it."""
        self.flat.remove_hooks()


class ModuleKeys:
    """For a wrapper of ``self.module``: its state dict is the module's, unprefixed,
    and one saved from a real DDP (``module.`` before each key) loads too."""

    module: nn.Module

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        keys = list(state_dict)
        if keys and all(k.startswith("module.") for k in keys):  # saved from a real DDP
            state_dict = {k.removeprefix("module."): v for k, v in state_dict.items()}
        return self.module.load_state_dict(state_dict, strict, assign)


class DDPView(ModuleKeys, nn.Module):
    """What a script that wrapped its model in DistributedDataParallel (or DataParallel)
    keeps using after `Session.prepare` unwrapped it for the flat all-reduce: ``.module``,
    ``no_sync()`` and ``require_backward_grad_sync`` (read at the forward, as DDP
    does: that forward's backward is not synced when it ends, only with a later
    one or, for what is left, at the optimizer step). Its
    state dict is the module's, unprefixed: a script that unwraps DDP models by type
    (``isinstance``) saves and loads the same keys as one that reads ``.module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.require_backward_grad_sync = True
        self.sync_on_backward = True  # as DDP, the flag as the last forward found it

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.sync_on_backward = self.require_backward_grad_sync
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with temporarily(self, "require_backward_grad_sync", False):
            yield


def _device(tensors: list[torch.Tensor]) -> torch.device:
    return tensors[0].device if tensors else torch.device("cpu")
