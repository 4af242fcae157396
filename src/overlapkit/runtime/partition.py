"""``partition``: the rank's cores divided between the step's compute threads and
the work beside it (loader workers, the prefetch feeder, checkpoint persists).

Before the first step the split follows what the optimizations declare
(`Optimization.cpu_demands`): compute keeps every core of the rank and the
background work shares them. After ``profile_steps`` steps the policy knows
what the background work really costs (the CPU time of its threads and
workers, read from /proc) and divides again: the background gets its share of
the rank's CPU time in cores of its own, compute the rest (its thread count
follows; see `split`). With ``spill`` the background may also use the compute
cores; wherever it shares them it runs at ``background_nice`` (19: only when
compute idles). Communication (gloo's threads) runs on the compute cores: it
works while the step waits for it.

Each thread or process is pinned with ``sched_setaffinity``; the split is in
the summary (``scheduler.partition``, one entry per rank) and in the trace.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict
from time import perf_counter
from typing import TYPE_CHECKING, Any, ClassVar

from . import cores as linux
from .arbitration import ArbitrationPolicy
from .optimization import Demand, Knob, Resource
from .split import Profile, Split, size_split

if TYPE_CHECKING:
    from .state import State


class PinGate:
    """Called by a loader worker (a process, or a thread of a back end) before each
    sample: the first time, and whenever the split changes, it moves its own thread
    onto its consumer's cores (at the background's priority where they are the
    compute cores too) and records its thread id, so that the policy can measure
    the CPU time it uses. It reaches worker processes by inheritance or pickling."""

    SLOTS = 256

    def __init__(self) -> None:
        self.mask = multiprocessing.RawArray("b", max(linux.available(), default=0) + 1)
        self.nice = multiprocessing.RawValue("i", 0)
        self.version = multiprocessing.RawValue("i", 0)
        self.slots = multiprocessing.Array("i", self.SLOTS)  # thread ids, with a lock
        self.counts = multiprocessing.RawArray("q", self.SLOTS)  # samples, one writer each
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def set(self, cores: tuple[int, ...], nice: int) -> None:
        for i in range(len(self.mask)):
            self.mask[i] = 1 if i in cores else 0
        self.nice.value = nice
        self.version.value += 1

    def tids(self) -> list[int]:
        with self.slots.get_lock():
            return [t for t in self.slots if t]

    def samples(self) -> int:
        return sum(self.counts)

    def __call__(self) -> None:
        local = self._local
        version = self.version.value
        if getattr(local, "seen", None) != version:
            tid = linux.this_thread()
            if version:  # placed before it is listed, like a joining thread
                linux.pin(tid, [i for i, on in enumerate(self.mask) if on])
                if self.nice.value:
                    linux.lower_priority(tid, self.nice.value)
            if not hasattr(local, "slot"):
                with self.slots.get_lock():
                    slot = next((i for i, t in enumerate(self.slots) if t in (0, tid)), None)
                    if slot is not None:
                        self.slots[slot] = tid
                local.slot = slot
            local.seen = version
        if local.slot is not None:
            self.counts[local.slot] += 1


class PartitionPolicy(ArbitrationPolicy):
    """``partition``: compute threads, loader workers, the feeder and the persist
    thread each on cores of their own, sized from a profile of the first steps."""

    name: ClassVar[str] = "partition"
    frameworks: ClassVar[tuple[str, ...]] = ("torch",)
    why_not: ClassVar[str] = (
        "TensorFlow runs its compute and tf.data threads in pools of its own, which "
        "cannot be placed on cores from outside (use free)"
    )
    knobs: ClassVar[tuple[Knob, ...]] = (
        Knob(
            name="profile_steps",
            type=int,
            default=3,
            low=0,
            high=1000,
            help="steps measured before the cores are divided by what the work costs "
            "(0: keep the split made at the start)",
        ),
        Knob(
            name="background_cores",
            type=int,
            default=None,
            low=0,
            high=4096,
            help="cores kept for loader workers, the feeder and persists (unset: "
            "their share of the CPU time in the profile)",
        ),
        Knob(
            name="spill",
            type=bool,
            default=True,
            help="background work with cores of its own may also use the compute cores",
        ),
        Knob(
            name="background_nice",
            type=int,
            default=0,
            low=0,
            high=19,
            help="CPU priority of background work where it shares the compute cores "
            "(19: only when they idle; measured, 19 starves latency-bound loading)",
        ),
    )

    def __init__(self, **settings: Any) -> None:
        self.settings = self.resolve(settings)
        self.split: Split | None = None
        self.history: list[dict[str, Any]] = []  # every split made, with its step
        self._demands: list[Demand] = []
        self._cores: list[int] = []
        self._threads: int | None = None
        self._joined: dict[str, set[int]] = defaultdict(set)
        self._gates: dict[str, PinGate] = {}
        self._lock = threading.Lock()
        self._mark: Callable[[int, str, dict[str, Any]], None] | None = None
        self._steps_seen = 0
        self._window: tuple[float, float, float, float, float, int] | None = None  # at start
        self._samples = 0  # taken by the steps of the profile
        self._restore: tuple[set[int], int] | None = None
        self._free_threads = 0

    # ------------------------------------------------------------- the split
    def arrange(
        self,
        state: State,
        demands: list[Demand],
        mark: Callable[[int, str, dict[str, Any]], None] | None = None,
    ) -> None:
        import torch

        world = state.world
        self._demands, self._mark = demands, mark
        self._restore = (set(linux.available()), torch.get_num_threads())
        self._free_threads = torch.get_num_threads()  # what free runs this rank with
        self._cores = linux.rank_share(linux.available(), world.local_rank, world.local_world_size)
        self._threads = world.threads
        self._divide(state.step, None)

    def _divide(self, step: int, profile: Profile | None) -> None:
        s = self.settings
        split = size_split(
            self._cores,
            self._demands,
            threads=self._threads,
            background_cores=s["background_cores"],
            spill=s["spill"],
            profile=profile,
        )
        with self._lock:
            self.split = split
            self.history.append({"step": step, **split.as_dict()})
        self._apply(split)
        if self._mark is not None:
            self._mark(step, "partition", split.as_dict())

    def _apply(self, split: Split) -> None:
        import torch

        if torch.get_num_threads() != split.compute_threads:
            torch.set_num_threads(split.compute_threads)  # new pool threads: pinned below
        # Under the lock: a thread joining now waits, then places itself by this split.
        with self._lock:
            joined = {tid: name for name, tids in self._joined.items() for tid in tids}
            for tid in linux.threads_of():
                if tid not in joined:
                    linux.pin(tid, split.compute)
            for tid, consumer in joined.items():
                self._place(split, consumer, tid)
            for consumer, gate in self._gates.items():
                gate.set(split.cores_of(consumer), self._nice(split, consumer))

    def _nice(self, split: Split, consumer: str) -> int:
        # The feeder hands each batch over to the step: a low priority would delay it.
        if consumer == "feeder" or not split.shares_compute(consumer):
            return 0
        return self.settings["background_nice"]

    def _place(self, split: Split, consumer: str, tid: int) -> None:
        linux.pin(tid, split.cores_of(consumer))
        if nice := self._nice(split, consumer):
            linux.lower_priority(tid, nice)

    # ------------------------------------------------------------ background
    def join(self, consumer: str) -> None:
        tid = linux.this_thread()
        with self._lock:  # placed before it is listed: a listed thread runs where it should
            if self.split is not None:
                self._place(self.split, consumer, tid)
            # Threads that have ended leave (a snapshot's copy thread lives one checkpoint).
            alive = {t for t in self._joined[consumer] if linux.cpu_seconds(t) is not None}
            self._joined[consumer] = alive | {tid}

    def worker_gate(
        self, consumer: str, *resources: Resource, on_cpu: bool = True
    ) -> Callable[[], None]:
        if consumer not in self._gates:
            gate = self._gates[consumer] = PinGate()
            if self.split is not None:
                gate.set(self.split.cores_of(consumer), self._nice(self.split, consumer))
        return self._gates[consumer]

    def _background_tids(self) -> tuple[set[int], set[int]]:
        """The ids of the joined threads, and of the workers (processes, or threads
        of this process) that are not also joined."""
        with self._lock:
            joined = {t for ts in self._joined.values() for t in ts}
        return joined, {t for gate in self._gates.values() for t in gate.tids()} - joined

    def _reading(self) -> tuple[float, float, float, float, float, int]:
        """Now: the time; this process's CPU time and, of it, its background
        threads'; the CPU time of the joined threads and of the workers; the samples
        the workers have loaded."""
        joined, workers = self._background_tids()
        mine = set(linux.threads_of())
        return (
            perf_counter(),
            time.process_time(),
            sum(linux.cpu_seconds(t) or 0.0 for t in (joined | workers) & mine),
            sum(linux.cpu_seconds(t) or 0.0 for t in joined),
            sum(linux.cpu_seconds(t) or 0.0 for t in workers),
            sum(gate.samples() for gate in self._gates.values()),
        )

    # --------------------------------------------------------------- profile
    def step_done(self, state: State, samples: int = 0) -> None:
        """The first step (start-up) is left out; the next ``profile_steps`` are
        measured, then the cores are divided again. ``samples``: what the step took."""
        self._steps_seen += 1
        steps = self.settings["profile_steps"]
        if not steps or self._steps_seen > steps + 1:
            return
        if self._steps_seen == 1:
            self._window = self._reading()
            self._samples = 0
            return
        self._samples += samples
        if self._steps_seen == steps + 1 and self._window is not None:
            wall, process, inside, threads, workers, loaded = (
                b - a for a, b in zip(self._window, self._reading(), strict=True)
            )
            background = max(0.0, threads) / steps
            per_sample = None
            if loaded > 0:
                per_sample = max(0.0, workers) / loaded
                background += per_sample * self._samples / steps
            else:  # the workers loaded nothing: ahead of the step all along
                background += max(0.0, workers) / steps
            # Compute: this process's CPU time less what its background threads used.
            compute = max(0.0, process - inside) / steps
            profile = Profile(steps, wall / steps, background, compute, per_sample)
            self._divide(state.step, profile)  # from the next step on

    def close(self) -> None:
        """Give the process's threads back the cores and thread count they had
        (the process may run another session)."""
        if self._restore is None:
            return
        import torch

        cores, threads = self._restore
        torch.set_num_threads(threads)
        for tid in linux.threads_of():
            linux.pin(tid, cores)
        self._restore = None

    def placements(self) -> dict[str, list[int]]:
        """The thread ids of the background work, by consumer (workers included)."""
        with self._lock:
            out = {name: sorted(tids) for name, tids in self._joined.items()}
        for name, gate in self._gates.items():
            out[name] = sorted({*out.get(name, []), *gate.tids()})
        return out

    def detail(self) -> dict[str, Any] | None:
        if self.split is None:
            return None
        out = {
            **self.split.as_dict(),
            "threads_placed": {name: len(tids) for name, tids in self.placements().items()},
            "demands": [asdict(d) for d in self._demands],
            "history": self.history,
            "notes": [],
        }
        if any(h["compute_threads"] != self._free_threads for h in self.history):
            out["notes"].append(
                f"compute ran with {self.split.compute_threads} threads where free runs "
                f"{self._free_threads}: torch's CPU kernels split their sums by thread, so "
                "losses can differ from a free run in the last bits"
            )
        return out
