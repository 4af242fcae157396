"""Measure what the partitioner needs: each layer's compute time, activation and
parameter size on one micro-batch, and the speed of the link between ranks."""

from __future__ import annotations

import copy
import statistics
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .layers import tensor_bytes
from .partition import LayerCost


def _requires_grad(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach()
        return value.requires_grad_(value.is_floating_point())
    if isinstance(value, tuple):
        return tuple(_requires_grad(v) for v in value)
    return value


def _float_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() and value.requires_grad else []
    if isinstance(value, tuple):
        return [t for v in value for t in _float_tensors(v)]
    return []


def _now(device: torch.device) -> float:
    """The host's clock once ``device`` has done the work queued on it: on a GPU the
    host runs ahead of its kernels (a wait that only the set-up pays, never a step)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return perf_counter()


def _time_layer(layer: nn.Module, x: Any, repeats: int, device: torch.device) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeats + 1):  # the first run warms up (allocations, lazy init)
        inputs = _requires_grad(x)
        start = _now(device)
        out = layer(*inputs) if isinstance(inputs, tuple) else layer(inputs)
        outputs = _float_tensors(out)
        if outputs:
            torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
        times.append(_now(device) - start)
    return min(times[1:]), out  # the least disturbed run (other processes share the cores)


def profile_layers(
    layers: list[tuple[str, nn.Module]], sample: Any, device: torch.device, repeats: int = 5
) -> list[LayerCost]:
    """Forward + backward time of each layer on ``sample`` (one micro-batch, on ``device``),
    on copies of the layers so that the model's buffers (batch-norm statistics) stay as
    they were."""
    costs = []
    x = sample
    for name, layer in layers:
        clone = copy.deepcopy(layer)
        seconds, out = _time_layer(clone, x, repeats, device)
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        costs.append(LayerCost(name, seconds, tensor_bytes(out), params))
        x = _detach(out)
    return costs


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(_detach(v) for v in value)
    return value


def measure_link(
    peer_a: int, peer_b: int, device: torch.device, nbytes: int = 4 << 20, repeats: int = 3
) -> float:
    """Bytes per second from ``peer_a`` to ``peer_b`` and back, in tensors on ``device``
    (this rank's: NCCL sends only CUDA tensors). Every rank calls it; the others return
    at once with 0."""
    rank = dist.get_rank()
    if rank not in (peer_a, peer_b):
        return 0.0
    buffer = torch.zeros(nbytes // 4, device=device)
    times = []
    for _ in range(repeats + 1):  # the first round warms up (NCCL connects on first use)
        start = _now(device)
        if rank == peer_a:
            dist.send(buffer, peer_b)
            dist.recv(buffer, peer_b)
        else:
            dist.recv(buffer, peer_a)
            dist.send(buffer, peer_a)
        times.append(_now(device) - start)
    return 2 * nbytes / statistics.median(times[1:])
