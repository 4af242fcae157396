"""The gradient synchronisation every multi-rank run needs when no optimization provides one.

All gradients are all-reduced once, as one flat buffer, after the backward
pass: nothing overlaps, so the whole all-reduce is exposed. This is also the
baseline that ``ddp_overlap`` is measured against.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def broadcast_model(model: nn.Module, src: int = 0) -> None:
    """Start every rank from rank ``src``'s parameters and buffers."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src)


class FlatAllReduce:
    """Averages gradients (and floating-point buffers, e.g. batch-norm statistics)
    across ranks with one all-reduce of one flat buffer."""

    def __init__(self, model: nn.Module, world_size: int) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.world_size = world_size
        self.bytes_per_call = sum(t.numel() * t.element_size() for t in self.params + self.buffers)

    @torch.no_grad()
    def __call__(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        tensors = grads + self.buffers
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat)
        flat /= self.world_size
        offset = 0
        for param, tensor in zip(self.params + [None] * len(self.buffers), tensors, strict=True):
            n = tensor.numel()
            view = flat[offset : offset + n].view_as(tensor)
            if param is not None and param.grad is None:
                param.grad = view.clone()
            else:
                tensor.copy_(view)
            offset += n
