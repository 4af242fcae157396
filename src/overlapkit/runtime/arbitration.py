"""Arbitration of shared resources between the training step and background work.

Critical-path code (the step itself, e.g. waiting for an all-reduce) marks the
resources it is using with `ArbitrationPolicy.critical`. Background work (a
checkpoint persist, a prefetch worker) wraps each chunk of its work in
`ArbitrationPolicy.background`. The policy decides whether a chunk may run now.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

from .optimization import Resource


class ArbitrationPolicy:
    """``free``: everything runs whenever it wants (the naive all-on baseline)."""

    name: ClassVar[str] = "free"

    @contextmanager
    def critical(self, *resources: Resource) -> Iterator[None]:
        """Mark ``resources`` as used by the critical path (the training step
        waiting on them) for the duration of the block."""
        yield

    def pause(self, *resources: Resource) -> None:
        """Called by background work between chunks: return when the chunk that
        needs ``resources`` may run."""

    @contextmanager
    def background(self, *resources: Resource) -> Iterator[None]:
        """One chunk of background work: waits at the start like `pause`."""
        self.pause(*resources)
        yield

    def stats(self) -> dict[str, float]:
        return {}


class PriorityPolicy(ArbitrationPolicy):
    """``priority``: a background chunk waits while the critical path uses one of
    its resources (it never interrupts a chunk already running). Background work
    that pauses between small chunks (a checkpoint persist writes 4 MiB at a time)
    therefore gets out of the way within one chunk."""

    name: ClassVar[str] = "priority"

    def __init__(self, max_wait_s: float = 5.0) -> None:
        self._active: Counter[Resource] = Counter()
        self._cond = threading.Condition()
        self._max_wait_s = max_wait_s  # background work must not starve forever
        self.yielded = 0
        self.yielded_s = 0.0

    @contextmanager
    def critical(self, *resources: Resource) -> Iterator[None]:
        with self._cond:
            self._active.update(resources)
        try:
            yield
        finally:
            with self._cond:
                self._active.subtract(resources)
                self._cond.notify_all()

    def _busy(self, resources: tuple[Resource, ...]) -> bool:
        return any(self._active[r] > 0 for r in resources)

    def pause(self, *resources: Resource) -> None:
        with self._cond:
            if self._busy(resources):
                self.yielded += 1
                start = time.perf_counter()
                self._cond.wait_for(lambda: not self._busy(resources), timeout=self._max_wait_s)
                self.yielded_s += time.perf_counter() - start

    def stats(self) -> dict[str, float]:
        return {"background_chunks_yielded": self.yielded, "background_yield_s": self.yielded_s}


POLICIES: dict[str, type[ArbitrationPolicy]] = {
    ArbitrationPolicy.name: ArbitrationPolicy,
    PriorityPolicy.name: PriorityPolicy,
}
