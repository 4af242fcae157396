"""Whether a second copy of the model, left out of the checkpoints, changed since the
run started (a DQN target network soft-updated from the model, an EMA kept by hand):
a resume would make it again as the script made it, silently. A copy left as it was
(a frozen teacher, a reference model) is no matter.

Two signs, either enough: its tensors' versions, which every in-place change moves on
(``copy_``, ``mul_``, ``load_state_dict``) and which cost nothing to read; and a sum of
each tensor, for changes made through ``.data`` (``target.data.copy_(...)``, how most
soft updates and EMAs are written), which a version does not see. On a GPU the sums
reach the host by an asynchronous copy, read at the next look: no wait on the device.
"""

from __future__ import annotations

from typing import Any

import torch


class ModelCopy:
    """A module to watch, as it is now."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.tensors = self._tensors()  # held: an id is never reused while watched
        self.versions = _versions(self.tensors)
        self.sums = _sums(self.tensors).cpu()
        self._pending: tuple[torch.Tensor, Any] | None = None  # (host sums, CUDA event)

    def changed(self) -> bool:
        tensors = self._tensors()
        if [id(t) for t in tensors] != [id(t) for t in self.tensors]:
            return True  # a tensor replaced (``target.weight = ...``)
        if _versions(tensors) != self.versions:
            return True
        sums = self._sums_now_or_later(tensors)
        return sums is not None and not torch.equal(sums, self.sums)

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.module.parameters(), *self.module.buffers()]

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
