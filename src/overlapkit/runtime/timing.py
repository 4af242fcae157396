"""Time marks on the host's clock or on a CUDA device's timeline, read later.

On a GPU the host queues kernels ahead of the device; timing them with the
host's clock measures when they were queued, and reading a device clock at
once (``event.synchronize()``) stops the host from running ahead, which is
the overlap being measured. So a mark on a GPU is a CUDA event, taken from a
pool and recorded on the current stream, and its time is read a few steps
later, when the event has long completed (`ready`). On a CPU a mark is the
host's clock and ready at once.

`Deferred` values and `AsyncScalar` carry the same idea to anything computed
from marks or tensors: made now, read when ready, never forcing a wait on the
hot path.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import Any

import torch

Mark = Any  # a float (host seconds) or a torch.cuda.Event
Seconds = float | Callable[[], float]  # a number now, or one computed once marks are ready


class Marks:
    """Makes time marks for one device: host clock readings, or CUDA events from a pool."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.on_device = device is not None and device.type == "cuda"
        self._free: list[Any] = []
        self.created = 0  # CUDA events made (the pool keeps this flat after warm-up)

    def mark(self, stream: Any = None) -> Mark:
        """Now: on the host's clock, or an event recorded on ``stream`` (the current one)."""
        if not self.on_device:
            return perf_counter()
        if self._free:
            event = self._free.pop()
        else:
            event = torch.cuda.Event(enable_timing=True)
            self.created += 1
        event.record(stream)
        return event

    def ready(self, mark: Mark) -> bool:
        """True once the mark's time can be read without waiting."""
        return not self.on_device or mark.query()

    @staticmethod
    def seconds(begin: Mark, end: Mark) -> float:
        """Seconds from ``begin`` to ``end`` (on a GPU, waits for ``end`` if it has not
        completed: call it on marks that are `ready`)."""
        if isinstance(begin, float):
            return end - begin
        end.synchronize()
        return begin.elapsed_time(end) / 1000.0

    def release(self, *marks: Mark) -> None:
        """Give marks whose times were read back to the pool."""
        if self.on_device:
            self._free.extend(m for m in marks if not isinstance(m, float))


def resolve(value: Seconds) -> float:
    return value() if callable(value) else value


class AsyncScalar:
    """A 0-d tensor's value on the host, copied without stopping the host: on a GPU
    into pinned memory on the current stream, readable once its event completed."""

    def __init__(self, tensor: torch.Tensor) -> None:
        tensor = tensor.detach()
        self._event: Any = None
        if tensor.device.type == "cuda":
            self._host = torch.empty((), dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor.reshape(()), non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor.reshape(())

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def value(self) -> float:
        if self._event is not None:
            self._event.synchronize()
        return float(self._host)
