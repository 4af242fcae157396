"""Arbitration of shared resources between the training step and background work.

Critical-path code (the step itself, e.g. waiting for an all-reduce) marks the
resources it is using with `ArbitrationPolicy.critical`. Background work (a
checkpoint persist, a prefetch worker) wraps each chunk of its work in
`ArbitrationPolicy.background`. The policy decides whether a chunk may run now.
Threads that work beside the step `join` the policy when they start, and loader
workers call its `worker_gate` before each sample: a policy that places work on
cores (``partition``, in `partition`) does it there.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

from .optimization import Demand, Knob, KnobError, Resource

if TYPE_CHECKING:
    from .state import State


class ArbitrationPolicy:
    """``free``: everything runs whenever it wants (the naive all-on baseline)."""

    name: ClassVar[str] = "free"
    # Its own settings, declared once: scenarios set them under scheduler.<name>,
    # `overlapkit list` shows them, the tuner can search them.
    knobs: ClassVar[tuple[Knob, ...]] = ()
    frameworks: ClassVar[tuple[str, ...]] = ("torch", "tensorflow")
    why_not: ClassVar[str] = ""  # why it does not run on the other frameworks

    @classmethod
    def resolve(cls, settings: dict[str, Any]) -> dict[str, Any]:
        """Every knob's value: its default, or the one given (validated)."""
        by_name = {k.name: k for k in cls.knobs}
        unknown = [key for key in settings if key not in by_name]
        if unknown:
            allowed = list(by_name)
            raise KnobError(
                unknown[0],
                f"the {cls.name} policy has no setting {unknown[0]!r}"
                + (f"; allowed: {', '.join(allowed)}" if allowed else "; it has none"),
                allowed,
            )
        return {
            k.name: k.coerce(settings[k.name]) if k.name in settings else k.default
            for k in cls.knobs
        }

    # Placement: only a policy that divides the cores does something here.
    def arrange(
        self,
        state: State,
        demands: list[Demand],
        mark: Callable[[int, str, dict[str, Any]], None] | None = None,
    ) -> None:
        """Before the first step, once the wrappers have started what they declare;
        ``mark(step, name, args)`` puts an instant into the trace."""

    def step_done(self, state: State, samples: int = 0) -> None:
        """After each step (``samples``: what it took on this rank)."""

    def join(self, consumer: str) -> None:
        """Called by a thread working beside the step (``consumer``: "feeder",
        "persist") when it starts."""

    def worker_gate(
        self, consumer: str, *resources: Resource, on_cpu: bool = True
    ) -> Callable[[], None] | None:
        """What a loader worker (``consumer``) calls before each sample; None: nothing."""
        return self.process_gate(*resources) if on_cpu else None

    def close(self) -> None:
        """After the last step: undo what the policy changed in this process."""

    def detail(self) -> dict[str, Any] | None:
        """This rank's part of the summary (the summary has one per rank); None: none."""
        return None

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

    def process_gate(self, *resources: Resource) -> Callable[[], None] | None:
        """`pause` for background work in other processes that this one starts
        afterwards (DataLoader workers inherit it); None: they never wait."""
        return None

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
        self._shared: SharedMarks | None = None  # made when a process gate is asked for

    @contextmanager
    def critical(self, *resources: Resource) -> Iterator[None]:
        with self._cond:
            self._active.update(resources)
            if self._shared is not None:
                self._shared.mark(resources, +1)
        try:
            yield
        finally:
            with self._cond:
                self._active.subtract(resources)
                if self._shared is not None:
                    self._shared.mark(resources, -1)
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

    def process_gate(self, *resources: Resource) -> Callable[[], None]:
        if self._shared is None:
            with self._cond:
                self._shared = SharedMarks()
                for resource, count in self._active.items():
                    self._shared.mark((resource,), count)
        return ProcessGate(self._shared, resources, self._max_wait_s)

    def stats(self) -> dict[str, float]:
        out = {"background_chunks_yielded": self.yielded, "background_yield_s": self.yielded_s}
        if self._shared is not None:
            out["worker_samples_yielded"], out["worker_yield_s"] = self._shared.yields()
        return out


RESOURCES = list(Resource)


class SharedMarks:
    """The critical path's marks in shared memory, for background work in other
    processes: per resource, how many critical sections use it now; and how often
    and how long those processes waited."""

    def __init__(self) -> None:
        self.counts = multiprocessing.RawArray("i", len(RESOURCES))
        self.waits = multiprocessing.Array("d", 2)  # (times, seconds), with a lock

    def mark(self, resources: tuple[Resource, ...], delta: int) -> None:
        for resource in resources:
            self.counts[RESOURCES.index(resource)] += delta

    def yields(self) -> tuple[int, float]:
        with self.waits.get_lock():
            return int(self.waits[0]), float(self.waits[1])


class ProcessGate:
    """Called by a worker process before each piece of its work: while the critical
    path uses one of ``resources``, wait (polling shared memory, at most
    ``max_wait_s``). It reaches workers by inheritance or by pickling at start."""

    POLL_S = 0.0005

    def __init__(
        self, shared: SharedMarks, resources: tuple[Resource, ...], max_wait_s: float
    ) -> None:
        self.shared = shared
        self.indices = [RESOURCES.index(r) for r in resources]
        self.max_wait_s = max_wait_s

    def _busy(self) -> bool:
        return any(self.shared.counts[i] > 0 for i in self.indices)

    def __call__(self) -> None:
        if not self._busy():
            return
        start = time.perf_counter()
        while self._busy() and time.perf_counter() - start < self.max_wait_s:
            time.sleep(self.POLL_S)
        with self.shared.waits.get_lock():
            self.shared.waits[0] += 1
            self.shared.waits[1] += time.perf_counter() - start
