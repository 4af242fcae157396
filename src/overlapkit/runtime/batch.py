"""Helpers for batches of any nesting: tensors, tuples, lists, mappings."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of ``batch`` on ``device``, the containers rebuilt as they were
    (lists, tuples, named tuples, dicts and other mappings); another object with a
    ``to`` method of its own (a graph, a batch class) is moved by it."""
    if isinstance(batch, torch.Tensor):
        if device.type == "cuda" and batch.device.type == "cpu" and not batch.is_pinned():
            # A copy from pageable memory makes the host wait for the device.
            batch = batch.pin_memory()
        return batch.to(device, non_blocking=True)
    if callable(getattr(batch, "to", None)) and not isinstance(batch, (str, bytes)):
        # Its own way first, containers included: a PackedSequence (a named tuple whose
        # batch_sizes stay on the CPU), Hugging Face's BatchEncoding (its encodings kept).
        try:
            return batch.to(device, non_blocking=True)
        except TypeError:  # a `to` that takes no non_blocking
            return batch.to(device)
    if isinstance(batch, (list, tuple, Mapping)):
        return _rebuilt(batch, [to_device(item, device) for item in _items(batch)])
    return batch


def tensors_in(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, (list, tuple, Mapping)):
        for item in _items(batch):
            yield from tensors_in(item)


FINGERPRINT_BYTES = 1 << 20  # of each tensor: enough to tell batches apart


def fingerprint(batch: Any) -> str | None:
    """A digest of ``batch``'s tensors (their shapes, dtypes and first bytes), to
    compare batches across ranks; None: no dense tensor in it."""
    digest, found = hashlib.sha1(), False
    for tensor in tensors_in(batch):
        digest.update(repr((tuple(tensor.shape), tensor.dtype, tensor.layout)).encode())
        if tensor.layout != torch.strided or tensor.is_quantized or not tensor.numel():
            continue
        found = True
        # Only the leading rows (elements of a vector) that hold the first bytes are
        # copied to the host: a whole graph on a GPU may be a gigabyte.
        rows = tensor.detach().reshape(-1) if tensor.dim() < 2 else tensor.detach()
        row_bytes = rows[0].numel() * rows.element_size()
        part = rows[: -(-FINGERPRINT_BYTES // row_bytes)].contiguous().cpu()
        digest.update(part.reshape(-1).view(torch.uint8)[:FINGERPRINT_BYTES].numpy().tobytes())
    return digest.hexdigest() if found else None


def _items(batch: list[Any] | tuple[Any, ...] | Mapping[Any, Any]) -> list[Any]:
    return list(batch.values()) if isinstance(batch, Mapping) else list(batch)


def _rebuilt(batch: Any, items: list[Any]) -> Any:
    """A container like ``batch`` holding ``items`` (its values, for a mapping)."""
    if isinstance(batch, Mapping):
        moved = dict(zip(batch.keys(), items, strict=True))
        try:
            return type(batch)(moved)
        except TypeError:  # a mapping that cannot be built from a dict
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*items)
    try:
        return type(batch)(items)
    except TypeError:
        return tuple(items) if isinstance(batch, tuple) else items


def batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size(batch[0])
    if isinstance(batch, Mapping) and batch:
        return batch_size(next(iter(batch.values())))
    return 1
