"""Phase one of a checkpoint: copy the training state into host memory.

Parameters and optimizer state change only in ``optimizer.step()``, so they
are copied in the background while the next forward and backward run; the
loop waits for the copy right before the next optimizer step. Everything
else (RNG states, loader position, batch-norm buffers, counters) can change
during the next forward and is small: it is copied at once.

Host buffers are allocated once, in the background after the first step, and
reused (pinned memory on a GPU, where the copy runs on a side CUDA stream and
the optimizer step's stream, not the host, waits for it), so host memory stays
flat across checkpoints. Each of 4 KiB or more starts on a 4 KiB boundary (the
smaller ones packed, as in the file), so the persist can write it with O_DIRECT.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable
from time import perf_counter
from typing import Any

import torch

from ...runtime.background import start_thread
from .fileformat import BLOCK, SMALL, packed

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
        if hasattr(tree, "_fields"):  # a namedtuple (a replay memory's transitions)
            return type(tree)(*items)
        return type(tree)(items) if isinstance(tree, tuple) else items
    return copy.deepcopy(tree)


def aligned_empty(
    shape: torch.Size, dtype: torch.dtype, pin: bool = False, align: int | None = None
) -> torch.Tensor:
    """An uninitialised CPU tensor whose data starts on an ``align``-byte boundary
    (None: as it would in a checkpoint file, see `fileformat.packed`)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if align is None:
        align = BLOCK if nbytes >= BLOCK else SMALL
    raw = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % align
    return raw[skip : skip + nbytes].view(dtype).view(shape)


def pinned_bytes(nbytes: int) -> int:
    """What torch's caching host allocator holds for a pinned request of ``nbytes``:
    the next power of two (so one slab, not hundreds of small blocks)."""
    return 1 << max(0, (nbytes - 1).bit_length())


Layout = list[tuple[str, torch.Size, torch.dtype]]


def tensor_layout(tree: Tree) -> Layout:
    """(place, shape, dtype) of every tensor in ``tree``, in order."""
    layout: Layout = []
    map_tree(tree, lambda path, t: layout.append((path, t.shape, t.dtype)))
    return layout


class HostBuffers:
    """One set of host tensors, keyed by their place in the state, reused from one
    snapshot to the next (reallocated only when a shape or dtype changes).

    `reserve` allocates a whole layout as one slab, each tensor placed as in the
    file (`fileformat.packed`: on a 4 KiB boundary, small ones packed): on a
    GPU, one pinned allocation instead of one per tensor (481 for a ResNet-50
    and its optimizer, 242 ms), made in the background before the first
    snapshot needs it (see `Snapshotter.reserve`)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.tensors: dict[str, torch.Tensor] = {}
        self.held_bytes = 0  # host memory really held (pinned: as the allocator rounds it)
        self.free = threading.Event()  # cleared while a snapshot or persist uses the buffers
        self.free.set()

    def reserve(self, layout: Layout) -> None:
        sizes = [math.prod(shape) * dtype.itemsize for _, shape, dtype in layout]
        offsets, total = packed(sizes)
        if not total:
            return
        slab = aligned_empty(torch.Size([total]), torch.uint8, pin=self.pin, align=BLOCK)
        for (path, shape, dtype), offset, nbytes in zip(layout, offsets, sizes, strict=True):
            self.tensors[path] = slab[offset : offset + nbytes].view(dtype).view(shape)
        self._hold(total, slack=BLOCK)

    def get(self, path: str, like: torch.Tensor) -> torch.Tensor:
        buffer = self.tensors.get(path)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = aligned_empty(like.shape, like.dtype, pin=self.pin)
            self.tensors[path] = buffer
            self._hold(buffer.numel() * buffer.element_size())
        return buffer

    def _hold(self, nbytes: int, slack: int | None = None) -> None:
        """Count an allocation of ``nbytes`` and its alignment ``slack`` (None: as
        `aligned_empty` takes it for that size)."""
        nbytes += slack if slack is not None else BLOCK if nbytes >= BLOCK else SMALL
        self.held_bytes += pinned_bytes(nbytes) if self.pin else nbytes

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
        self.copy_s = 0.0  # the background copy, start to finish (known once `wait` returned)
        self._done = threading.Event()
        self._cuda_events: tuple[Any, Any] | None = None  # the side stream's copies begin, end
        self.error: BaseException | None = None

    def wait(self) -> None:
        """Until the host buffers hold the snapshot (the persist thread waits here)."""
        if self._cuda_events is not None:
            begin, end = self._cuda_events
            end.synchronize()
            self.copy_s = begin.elapsed_time(end) / 1000.0  # on the device's timeline
        else:
            self._done.wait()
        if self.error is not None:
            raise self.error

    def wait_on_device(self) -> None:
        """Make what runs next wait until the copies are done: on a GPU the current
        stream waits for them, not the host; on a CPU the host waits."""
        if self._cuda_events is not None:
            torch.cuda.current_stream().wait_event(self._cuda_events[1])
        else:
            self.wait()


class Snapshotter:
    """Takes snapshots into reused host buffers, deferring the tensors in
    ``deferrable`` (by storage address) to the background."""

    def __init__(
        self,
        device: torch.device,
        buffer_sets: int = 1,
        join: Callable[[], None] | None = None,
    ) -> None:
        self.device = device
        self._join = join  # called first on each background copy's thread
        self.sets = [HostBuffers(pin=device.type == "cuda") for _ in range(buffer_sets)]
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._reserving: threading.Thread | None = None

    def reserve(self, layout: Layout) -> None:
        """Allocate every buffer set for ``layout`` in a background thread: pinning
        host memory takes long, and must not happen inside a stall."""

        def allocate() -> None:
            for buffers in self.sets:
                buffers.reserve(layout)

        self._reserving = start_thread(allocate, name="overlapkit-host-buffers")

    def _reserved(self) -> None:
        """Wait for the background reservation (started steps ago: done by now, unless
        every=1 or the run ended at once)."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def free_buffers(self) -> HostBuffers:
        """A buffer set no persist is reading (waits for one if needed)."""
        self._reserved()
        while True:
            for buffers in self.sets:
                if buffers.free.is_set():
                    buffers.free.clear()
                    return buffers
            self.sets[0].free.wait(0.01)

    @property
    def held_bytes(self) -> int:
        """Host memory the buffer sets hold (pinned: as the allocator rounds it)."""
        self._reserved()
        return sum(b.held_bytes for b in self.sets)

    @property
    def buffer_bytes(self) -> int:
        """The bytes of state the buffer sets have room for."""
        self._reserved()
        return sum(b.nbytes for b in self.sets)

    def take(self, step: int, state: Tree, deferrable: set[int] | None) -> Snapshot:
        """Copy ``state`` into host buffers: now what may change in the next step, in
        the background what is ``deferrable`` (None: everything)."""
        buffers = self.free_buffers()
        deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        on_gpu = self._stream is not None

        def to_host(path: str, tensor: torch.Tensor) -> torch.Tensor:
            buffer = buffers.get(path, tensor)
            if deferrable is None or tensor.untyped_storage().data_ptr() in deferrable:
                deferred.append((buffer, tensor.detach()))
            else:
                # What the next forward may change (batch-norm statistics): copied now,
                # on a GPU in stream order (later kernels cannot overtake it), no wait.
                buffer.copy_(tensor.detach(), non_blocking=on_gpu and tensor.is_cuda)
            return buffer

        snapshot = Snapshot(step, map_tree(state, to_host), buffers)
        if self._stream is not None:
            # The side stream starts after the work that produced the values (and
            # after the copies made now, so its end is the end of the whole snapshot).
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            with torch.cuda.stream(self._stream):
                begin.record()
                for buffer, tensor in deferred:
                    buffer.copy_(tensor, non_blocking=True)
                    if tensor.is_cuda:  # a temporary's memory waits for this copy
                        tensor.record_stream(self._stream)
                end.record()
            snapshot._cuda_events = (begin, end)
        else:
            start_thread(self._copy_in_background, snapshot, deferred, name="overlapkit-snapshot")
        return snapshot

    def _copy_in_background(
        self, snapshot: Snapshot, deferred: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        if self._join is not None:
            self._join()
        self._copy(snapshot, deferred)

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
