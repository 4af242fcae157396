"""Hands batches to the training thread ahead of time, from a background thread.

On a GPU the thread copies each batch to the device on a side CUDA stream
(from pinned memory, so the copy is asynchronous) and records an event; the
training thread's stream waits on that event, not the whole device. On a CPU
the thread does the loading and collating that would otherwise happen on the
training thread, and hands over finished batches.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import torch

from ...data.worker_rng import capture, drawn_between
from ...runtime.background import start_thread
from ...runtime.batch import tensors_in, to_device

_DONE = object()


class Feeder:
    """Iterates ``source`` in a thread, keeping up to ``depth`` batches ready."""

    def __init__(
        self,
        source: Iterator[Any],
        device: torch.device,
        depth: int,
        gate: Callable[[], None] | None = None,
        join: Callable[[], None] | None = None,
    ) -> None:
        self.device = device
        self._gate = gate  # called before loading each batch: background work may wait
        self._join = join  # called once on the thread: the policy may place it
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # The process's global RNGs that loading the first batch drew from (the
        # dataset's __getitem__ without workers): set before that batch is handed over.
        self.first_load_draws: list[str] = []
        self._thread = start_thread(
            self._run, source, name="overlapkit-prefetch", stop=self._stop_soon
        )

    def _run(self, source: Iterator[Any]) -> None:
        try:
            if self._join is not None:
                self._join()
            # On a GPU the back end's own copies (DALI's) and ours run on the side stream.
            with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
                first = True
                while True:
                    if self._gate is not None:
                        self._gate()
                    # Training waits for the first batch: what draws meanwhile is loading.
                    before = capture() if first else None
                    try:
                        batch = next(source)
                    except StopIteration:
                        break
                    if before is not None:
                        self.first_load_draws = drawn_between(before, capture())
                        first = False
                    event = None
                    if self._stream is not None:
                        batch = to_device(batch, self.device)
                        event = torch.cuda.Event()
                        event.record(self._stream)
                    if not self._put((batch, event)):
                        return
            self._put(_DONE)
        except BaseException as error:  # raised again on the training thread
            self._put(error)
        finally:
            # Close the source here, on its own thread: a DataLoader iterator left to
            # the garbage collector can lose its shutdown message and wait 5 s a worker.
            close = getattr(source, "close", None)
            if close is not None:
                close()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[Any]:
        try:
            while True:
                item = self._queue.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                batch, event = item
                if event is not None:
                    current = torch.cuda.current_stream(self.device)
                    current.wait_event(event)
                    for tensor in tensors_in(batch):
                        tensor.record_stream(current)  # freed only after compute used it
                yield batch
        finally:
            self.close()

    def close(self) -> None:
        self._stop_soon()
        self._thread.join(timeout=5)

    def _stop_soon(self) -> None:
        """The thread ends after the batch it is loading."""
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
