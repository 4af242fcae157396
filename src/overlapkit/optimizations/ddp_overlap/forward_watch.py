"""DDP syncs the gradients of a backward only when a forward through its wrapper came
before it: a script that calls a part of its model directly (``layer.forward(x)``, as
mnist_forward_forward trains each layer) gets gradients that DDP never averages, and
its replicas part, silently. `ForwardWatch` counts the forwards through the wrapper
and the backward passes that reach the model's parameters, and refuses a pass that
no forward through it came before."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ...runtime.gradsync import BackwardEnd, ModuleKeys
from ...runtime.hooks import SessionHook


class ScriptDDP(ModuleKeys, DistributedDataParallel):
    """The DistributedDataParallel `Session.prepare` returns under ddp_overlap: it also
    answers for its model's own attributes, as the model did on one rank, where
    ddp_overlap is off (vae's ``model.decode(sample)`` after each epoch failed on 2
    ranks with an AttributeError). A training forward through such a method bypasses
    DDP: `ForwardWatch` refuses its backward. Its ``state_dict`` is the model's, keys
    as on one rank (``module.`` before each, a script's ``torch.save(model.state_dict())``
    on 2 ranks did not load into its model on one)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError as missing:
            error = missing
        module = self.__dict__.get("_modules", {}).get("module")
        if module is None:  # (while DDP sets itself up)
            raise error
        try:
            return getattr(module, name)
        except AttributeError:
            raise error from None


class UnsyncedBackward(RuntimeError):
    """A backward reached the model's parameters with no forward through DDP before it."""


class ForwardWatch:
    def __init__(self, ddp: nn.Module) -> None:
        self.waiting = 0  # training forwards through the wrapper whose backward has not ended
        self._end = BackwardEnd(self._pass_ended)
        params = [p for p in ddp.parameters() if p.requires_grad]
        self._handles = [ddp.register_forward_pre_hook(SessionHook(self._forward))]
        self._handles += [p.register_post_accumulate_grad_hook(self._accumulated) for p in params]

    def _forward(self, module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self.waiting += 1

    def _accumulated(self, param: torch.Tensor) -> None:
        if self._end.armed_now():  # this pass was checked at its first gradient
            return
        if self.waiting <= 0:
            raise UnsyncedBackward(
                "ddp_overlap: a backward reached the model's parameters with no forward "
                "through the model before it (a part of it called directly, as "
                "layer.forward(x)): DistributedDataParallel syncs nothing then, and the "
                "ranks' replicas would part. Call the prepared model itself, or leave "
                "ddp_overlap out (overlapkit's own all-reduce syncs any backward)"
            )
        self._end.arm()

    def _pass_ended(self) -> None:
        self.waiting -= 1

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
