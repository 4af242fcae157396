"""Arbitration of shared resources between the training step and background work.

Critical-path code (the step itself, e.g. waiting for an all-reduce) marks the
resources it is using with `ArbitrationPolicy.critical`. Background work (a
checkpoint persist, a prefetch worker) wraps each chunk of its work in
`ArbitrationPolicy.background`. The policy decides whether a chunk may run now.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

from .optimization import Resource


class ArbitrationPolicy:
    """``free``: everything runs whenever it wants (the naive all-on baseline)."""

    name: ClassVar[str] = "free"

    @contextmanager
    def critical(self, resource: Resource) -> Iterator[None]:
        yield

    @contextmanager
    def background(self, resource: Resource) -> Iterator[None]:
        yield

    def stats(self) -> dict[str, float]:
        return {}


class PriorityPolicy(ArbitrationPolicy):
    """``priority``: a background chunk waits while the critical path uses its
    resource (it never interrupts a chunk already running)."""

    name: ClassVar[str] = "priority"

    def __init__(self, max_wait_s: float = 5.0) -> None:
        self._active: Counter[Resource] = Counter()
        self._cond = threading.Condition()
        self._max_wait_s = max_wait_s  # background work must not starve forever
        self.yielded = 0

    @contextmanager
    def critical(self, resource: Resource) -> Iterator[None]:
        with self._cond:
            self._active[resource] += 1
        try:
            yield
        finally:
            with self._cond:
                self._active[resource] -= 1
                self._cond.notify_all()

    @contextmanager
    def background(self, resource: Resource) -> Iterator[None]:
        with self._cond:
            if self._active[resource]:
                self.yielded += 1
                self._cond.wait_for(lambda: not self._active[resource], timeout=self._max_wait_s)
        yield

    def stats(self) -> dict[str, float]:
        return {"background_chunks_yielded": self.yielded}


POLICIES: dict[str, type[ArbitrationPolicy]] = {
    ArbitrationPolicy.name: ArbitrationPolicy,
    PriorityPolicy.name: PriorityPolicy,
}
