"""Phase one of a checkpoint: copy the training state into host memory.

Parameters and optimizer state change only in ``optimizer.step()``, so they
are copied in the background while the next forward and backward run; the
loop waits for the copy right before the next optimizer step. Everything
else (RNG states, loader position, batch-norm buffers, counters) can change
during the next forward and is small: it is copied at once.

Host buffers are allocated once and reused (pinned memory on a GPU, where the
copy runs on a side CUDA stream), so host memory stays flat across checkpoints.
Each starts on a 4 KiB boundary, so the persist can write it with O_DIRECT.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable
from time import perf_counter
from typing import Any

import torch

Tree = Any


def map_tree(tree: Tree, fn: Callable[[str, torch.Tensor], Any], path: str = "") -> Tree:
    """Rebuild a nest of dicts, lists and tuples with ``fn(path, tensor)`` for each tensor
    and a deep copy of every other value."""
    if isinstance(tree, torch.Tensor):
        return fn(path, tree)
    if isinstance(tree, dict):
        return {k: map_tree(v, fn, f"{path}/{k}") for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [map_tree(v, fn, f"{path}/{i}") for i, v in enumerate(tree)]
        return type(tree)(items) if isinstance(tree, tuple) else items
    return copy.deepcopy(tree)


def aligned_empty(
    shape: torch.Size, dtype: torch.dtype, pin: bool = False, align: int = 4096
) -> torch.Tensor:
    """An uninitialised CPU tensor whose data starts on an ``align``-byte boundary."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % align
    return raw[skip : skip + nbytes].view(dtype).view(shape)


class HostBuffers:
    """One set of host tensors, keyed by their place in the state, reused from one
    snapshot to the next (reallocated only when a shape or dtype changes)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.tensors: dict[str, torch.Tensor] = {}
        self.free = threading.Event()  # cleared while a snapshot or persist uses the buffers
        self.free.set()

    def get(self, path: str, like: torch.Tensor) -> torch.Tensor:
        buffer = self.tensors.get(path)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = aligned_empty(like.shape, like.dtype, pin=self.pin)
            self.tensors[path] = buffer
        return buffer

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class Snapshot:
    """A snapshot in progress: ``tree`` holds host tensors once `wait` returns."""

    def __init__(self, step: int, tree: Tree, buffers: HostBuffers) -> None:
        self.step = step
        self.tree = tree
        self.buffers = buffers
        self.started = perf_counter()
        self.copy_s = 0.0  # the whole copy, start to finish
        self._done = threading.Event()
        self._cuda_event: Any = None
        self.error: BaseException | None = None

    def wait(self) -> None:
        if self._cuda_event is not None:
            self._cuda_event.synchronize()
            self.copy_s = perf_counter() - self.started
        else:
            self._done.wait()
        if self.error is not None:
            raise self.error


class Snapshotter:
    """Takes snapshots into reused host buffers, deferring the tensors in
    ``deferrable`` (by storage address) to the background."""

    def __init__(self, device: torch.device, buffer_sets: int = 1) -> None:
        self.device = device
        self.sets = [HostBuffers(pin=device.type == "cuda") for _ in range(buffer_sets)]
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def free_buffers(self) -> HostBuffers:
        """A buffer set no persist is reading (waits for one if needed)."""
        while True:
            for buffers in self.sets:
                if buffers.free.is_set():
                    buffers.free.clear()
                    return buffers
            self.sets[0].free.wait(0.01)

    def take(self, step: int, state: Tree, deferrable: set[int]) -> Snapshot:
        buffers = self.free_buffers()
        deferred: list[tuple[torch.Tensor, torch.Tensor]] = []

        def to_host(path: str, tensor: torch.Tensor) -> torch.Tensor:
            buffer = buffers.get(path, tensor)
            if tensor.untyped_storage().data_ptr() in deferrable:
                deferred.append((buffer, tensor.detach()))
            else:
                buffer.copy_(tensor.detach())
            return buffer

        snapshot = Snapshot(step, map_tree(state, to_host), buffers)
        if self._stream is not None:
            # The side stream starts after the work that produced the values.
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for buffer, tensor in deferred:
                    buffer.copy_(tensor, non_blocking=True)
                snapshot._cuda_event = torch.cuda.Event()
                snapshot._cuda_event.record(self._stream)
        else:
            threading.Thread(
                target=self._copy,
                args=(snapshot, deferred),
                name="overlapkit-snapshot",
                daemon=True,
            ).start()
        return snapshot

    @staticmethod
    def _copy(snapshot: Snapshot, deferred: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        try:
            with torch.no_grad():
                for buffer, tensor in deferred:
                    buffer.copy_(tensor)  # releases the GIL: overlaps the training thread
        except BaseException as error:  # reported to the training thread by wait()
            snapshot.error = error
        finally:
            snapshot.copy_s = perf_counter() - snapshot.started
            snapshot._done.set()
