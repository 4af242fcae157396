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
        model = getattr(model, "_orig_mod", model)  # compiled: its own names, not _orig_mod.
        self.shapes = _shapes(model) or {}  # none (a lazy module's): nothing is a copy
        self.own = {_storage(t) for t in (*model.parameters(), *model.buffers())}

    def copy_of(self, value: Any) -> tuple[list[torch.Tensor], str] | None:
        """`_copy_of`, or None where looking raised (a module not built yet, on the meta
        device, with sparse or quantized tensors): a checkpoint never fails on it."""
        try:
            return self._copy_of(value)
        except Exception:  # noqa: BLE001 - a variable that is no copy of ours
            return None

    def _copy_of(self, value: Any) -> tuple[list[torch.Tensor], str] | None:
        """The tensors of ``value`` when it copies the model's weights, apart from
        them, and how to register it: a module of the model's shapes (or holding one:
        timm's ModelEmaV2), a dict of tensors of its state dict's keys and shapes (the
        best weights kept), or an object holding such a dict (None: anything else,
        the model itself, a wrapper of it)."""
        shapes = self.shapes
        if not shapes:
            return None
        found: tuple[list[torch.Tensor], str] | None = None
        if isinstance(value, nn.Module):
            # It, or a module it holds (timm's ModelEmaV2 keeps its copy as .module).
            for module in (value, *value.children()):
                state = module.state_dict(keep_vars=True)  # its weights (no scratch buffers)
                tensors = list(state.values())
                same = {k: v.shape for k, v in state.items()} == shapes
                if same and not any(_storage(t) in self.own for t in tensors):
                    found = tensors, "{name}={name}"
                    break
        elif isinstance(value, dict):
            tensors = _state_of(value, shapes)
            found = None if tensors is None else (tensors, "{name}=lambda: {name}")
        elif hasattr(value, "__dict__") and not isinstance(value, NOT_HOLDERS):
            for attr, held in vars(value).items():
                tensors = _state_of(held, shapes) if isinstance(held, dict) else None
                if tensors is not None:
                    found = tensors, f"{{name}}=lambda: {{name}} and {{name}}.{attr}"
                    break
        if found is None:
            return None
        if any(_storage(t) in self.own for t in found[0]):
            return None  # the model, or its state dict: its own tensors
        if any(t.is_meta or t.is_sparse or t.is_quantized for t in found[0]):
            return None  # nothing to read of it (none of a resume's concern)
        return found


def _shapes(model: nn.Module) -> dict[str, torch.Size] | None:
    try:
        return {k: v.shape for k, v in model.state_dict().items()}
    except Exception:  # noqa: BLE001 - a lazy module not built yet: no shapes
        return None


def _storage(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - a sparse tensor: no storage of its own
        return None


def same_weights(tensors: list[torch.Tensor], module: nn.Module) -> bool:
    """Whether ``tensors`` are, bit for bit, ``module``'s weights now (a state dict
    made from it this step: DQN's soft update's, loaded into its target network)."""
    state = list(module.state_dict().values())
    if len(state) != len(tensors):
        return False
    with torch.no_grad():
        return all(
            a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b.to(a.device))
            for a, b in zip(tensors, state, strict=True)
        )


def _state_of(held: dict[Any, Any], shapes: dict[str, torch.Size]) -> list[torch.Tensor] | None:
    if held.keys() != shapes.keys():
        return None
    if all(isinstance(t, torch.Tensor) and t.shape == shapes[k] for k, t in held.items()):
        return list(held.values())
    return None


class ModelCopy:
    """A copy to watch (the object a script variable names), as it is now."""

    def __init__(
        self, value: Any, tensors: list[torch.Tensor], register: str, where: Any = None
    ) -> None:
        self.value = value
        self.register = register  # session.start's argument, "{name}" to fill in
        self.where = where  # the code of the function whose variable names it
        self.kept = False  # a dict bound to weights nothing else held: told if it stays
        self.seen_at = 0  # the step it was first seen at
        self.tensors = tensors  # held: an id is never reused while watched
        self.versions = _versions(tensors)
        self.sums = _sums(tensors).cpu()
        self._pending: tuple[torch.Tensor, Any] | None = None  # (host sums, CUDA event)

    def changed(self, tensors: list[torch.Tensor], wait: bool = False) -> bool:
        """Whether the copy, now of ``tensors``, changed since: a tensor replaced,
        changed in place or through ``.data`` (on a GPU, as of the previous look,
        unless ``wait``)."""
        if [id(t) for t in tensors] != [id(t) for t in self.tensors]:
            return True
        if _versions(tensors) != self.versions:
            return True
        sums = self._sums_now_or_later(tensors, wait)
        # Bit for bit: a NaN (an uninitialised buffer) is no change.
        return sums is not None and not torch.equal(_bits(sums), _bits(self.sums))

    def _sums_now_or_later(self, tensors: list[torch.Tensor], wait: bool) -> torch.Tensor | None:
        """The sums now (on the CPU, or with ``wait``), or those launched at the
        previous look, if they have arrived (on a GPU: these are launched now, to be
        read at the next)."""
        sums = _sums(tensors)
        if sums.device.type != "cuda" or wait:
            return sums.cpu()
        arrived, self._pending = self._pending, None
        with torch.cuda.device(sums.device):  # the copy's and the event's stream
            host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
            host.copy_(sums, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self._pending = (host, event)
        if arrived is not None and arrived[1].query():
            return arrived[0]
        return None


def _bits(sums: torch.Tensor) -> torch.Tensor:
    return sums.view(torch.int64)


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
