"""Copies of the model's weights kept apart from it and left out of the checkpoints: a
DQN target network soft-updated from the model, an EMA kept by hand (a module, or an
object holding a state dict of clones: airbench's lookahead). Once the run
changes one, a resume makes it again as the script made it, silently. One left as it
was (a frozen teacher, a reference model) is no matter.

Two signs of a change, either enough: its tensors' versions, which every in-place
change moves on (``copy_``, ``lerp_``, ``load_state_dict``) and which cost nothing to
read; and a sum of each tensor, for changes made through ``.data``
(``target.data.copy_(...)``, how most soft updates and EMAs are written), which a
version does not see. On a GPU the sums reach the host by an asynchronous copy, read
at the next look: no wait on the device.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

NOT_HOLDERS = (types.ModuleType, type, types.FunctionType, types.MethodType, torch.Tensor)


class CopyFinder:
    """Tells copies of ``model``'s weights kept apart from them (see `copy_of`)."""

    def __init__(self, model: nn.Module) -> None:
        self.shapes = {k: v.shape for k, v in model.state_dict().items()}
        self.own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}

    def copy_of(self, value: Any) -> tuple[list[torch.Tensor], str] | None:
        """The tensors of ``value`` when it copies the model's weights, apart from
        them, and how to register it: a module of the model's shapes, or an object
        holding a dict of tensors of its state dict's keys and shapes (None: anything
        else, the model itself, a wrapper of it). A plain dict is left alone: one
        made anew each step (DQN's soft update builds the target's next state dict in
        a variable) is no state, and nothing tells it from the best weights kept."""
        shapes = self.shapes
        if not shapes:
            return None
        found: tuple[list[torch.Tensor], str] | None = None
        if isinstance(value, nn.Module):
            if {k: v.shape for k, v in value.state_dict().items()} == shapes:
                found = [*value.parameters(), *value.buffers()], "{name}={name}"
        elif hasattr(value, "__dict__") and not isinstance(value, NOT_HOLDERS):
            for attr, held in vars(value).items():
                tensors = _state_of(held, shapes) if isinstance(held, dict) else None
                if tensors is not None:
                    found = tensors, f"{{name}}=lambda: {{name}} and {{name}}.{attr}"
                    break
        if found is None:
            return None
        if any(t.untyped_storage().data_ptr() in self.own for t in found[0]):
            return None  # the model, or its state dict: its own tensors
        return found


def _state_of(held: dict[Any, Any], shapes: dict[str, torch.Size]) -> list[torch.Tensor] | None:
    if held.keys() != shapes.keys():
        return None
    if all(isinstance(t, torch.Tensor) and t.shape == shapes[k] for k, t in held.items()):
        return list(held.values())
    return None


class ModelCopy:
    """A copy to watch (the object a script variable names), as it is now."""

    def __init__(self, value: Any, tensors: list[torch.Tensor], register: str) -> None:
        self.value = value
        self.register = register  # session.start's argument, "{name}" to fill in
        self.tensors = tensors  # held: an id is never reused while watched
        self.versions = _versions(tensors)
        self.sums = _sums(tensors).cpu()
        self._pending: tuple[torch.Tensor, Any] | None = None  # (host sums, CUDA event)

    def changed(self, value: Any, tensors: list[torch.Tensor] | None) -> bool:
        """Whether the variable now names ``value``, a copy of ``tensors`` (None: no
        copy now), changed since: bound anew (another EMA made), a tensor
        replaced, changed in place or through ``.data``."""
        if value is not self.value or tensors is None:
            return True
        if [id(t) for t in tensors] != [id(t) for t in self.tensors]:
            return True
        if _versions(tensors) != self.versions:
            return True
        sums = self._sums_now_or_later(tensors)
        return sums is not None and not torch.equal(sums, self.sums)

    def _sums_now_or_later(self, tensors: list[torch.Tensor]) -> torch.Tensor | None:
        """The sums now (on the CPU), or those launched at the previous look, if they
        have arrived (on a GPU: these are launched now, to be read at the next)."""
        sums = _sums(tensors)
        if sums.device.type != "cuda":
            return sums
        arrived, self._pending = self._pending, None
        host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
        host.copy_(sums, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (host, event)
        if arrived is not None and arrived[1].query():
            return arrived[0]
        return None


def _versions(tensors: list[torch.Tensor]) -> list[int]:
    # A tensor made under inference mode has no version (and no in-place change
    # outside that mode): its sum watches it.
    return [-1 if t.is_inference() else t._version for t in tensors]


def _sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's sum, in float64 (summed as such: no copy of the tensor made)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    device = tensors[0].device
    with torch.no_grad():
        real = [torch.view_as_real(t) if t.is_complex() else t for t in tensors]
        return torch.stack([t.detach().sum(dtype=torch.float64).to(device) for t in real])
