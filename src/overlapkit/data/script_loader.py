"""Exact resume for a script's own map-style `DataLoader`, in the script's own order.

A `DataLoader` draws its randomness when an epoch starts: the workers' base seed
and, for a `RandomSampler` without a generator, the seed of the epoch's
shuffle, both from the global RNG (or the generators the script gave it).
`ScriptLoader` iterates a copy of the script's loader (same dataset, sampler,
batch size, workers, collate function...) whose sampler can start at any batch.
It remembers the RNG states at the start of each epoch; to continue an epoch
mid-way (after a resume) it sets them back, lets the loader draw exactly what it
drew then, skips the batches already trained on (indices only, no loading), and
puts the current RNG states back. Without a resume it draws exactly what the
script's loader draws, at the same moments: a port stays bit-identical.
"""

from __future__ import annotations

import gc
import itertools
import sys
import weakref
from collections import deque
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data.dataloader import _BaseDataLoaderIter

from .sampler import ShardedSampler, _shut_down_workers
from .worker_rng import Stamped, Stamping, WorkerStart, from_saved, to_saved
from .worker_watch import ends_with_parent

# The DataLoader settings a copy keeps (prefetch may change the first five).
SETTINGS = (
    "num_workers",
    "pin_memory",
    "prefetch_factor",
    "persistent_workers",
    "in_order",
    "collate_fn",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
)
KNOWN_SAMPLERS = (
    SequentialSampler,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    DistributedSampler,
    ShardedSampler,
)
_END = object()
# Recent batches whose workers' RNG states are kept: more than a prefetching loader
# takes ahead of training (its depth, at most 256) plus one per worker.
STAMPS_KEPT = 512


def resume_problem(loader: Any) -> str | None:
    """Why ``loader`` cannot resume exactly mid-epoch (None: it can)."""
    if not hasattr(loader, "__iter__") and not hasattr(loader, "__getitem__"):
        name = type(loader).__name__
        return (
            f"the loader ({name}) is not iterable: a step is a batch the script takes by "
            f"iterating the loader prepare returns, and {name}'s own calls (a next()) "
            "hand theirs out past the session, so no step is taken, nor any checkpoint. "
            "Prepare the DataLoader it reads, before it makes an iterator of it"
        )
    if hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict"):
        return None
    if not isinstance(loader, DataLoader):
        return (
            f"the loader ({type(loader).__name__}) has no state_dict: a resumed run starts "
            "its epoch again at batch 0 (the same batches again, unless each is drawn from "
            "the global RNG, which is restored: nanoGPT's get_batch resumes exactly). Pass "
            "a map-style torch DataLoader, or give the loader state_dict/load_state_dict"
        )
    if isinstance(loader.dataset, IterableDataset):
        return (
            "the DataLoader reads an IterableDataset, which has no position to return to: a "
            "resumed run starts its epoch again at batch 0"
        )
    return None


def sampler_note(loader: DataLoader) -> str | None:
    """A note when the loader's sampler is not one whose draws are known to replay."""
    batches = loader.batch_sampler
    if batches is not None and type(batches) is not BatchSampler:
        kind = type(batches).__name__
    elif not isinstance(loader.sampler, KNOWN_SAMPLERS):
        kind = type(loader.sampler).__name__
    else:
        return None
    return (
        f"the loader's sampler {kind} is not one of torch's: resume replays its draws and is "
        "exact only if it draws from torch's RNG or its own generator (or is deterministic)"
    )


def _held_once() -> int:
    """What sys.getrefcount says of an object held by one attribute and one local
    variable, as `iterated_note` holds a loader's sampler (3 up to Python 3.13; a
    later Python may count borrowed references otherwise)."""
    holder = SimpleNamespace(held=object())
    held = holder.held
    return sys.getrefcount(held)


HELD_ONCE = _held_once()


def iterated_note(loader: DataLoader) -> str | None:
    """A note when an iterator of ``loader``, made before `prepare` and no batch taken
    from it yet, is held (makemore's InfiniteDataLoader keeps ``iter(self.train_loader)``
    to train from; a port hands it the loader prepare returns): making it drew the
    workers' base seed, which the prepared loader draws again at its first batch, so
    its shuffle was another than the script's, silently. A DataLoader keeps no count of
    its iterators, so they are looked for among the live objects (0.08 s among 300,000
    here), when something besides the loader holds its sampler. One that handed out a batch (a look at the data, kept) is no matter: the
    script then iterates the loader again, as the port does."""
    index_sampler = loader._index_sampler
    # Held by the loader and here only: no iterator holds it, and the look among every
    # live object is spared (300,000 in a test process).
    if sys.getrefcount(index_sampler) <= HELD_ONCE:
        return None
    if not any(
        issubclass(type(obj), _BaseDataLoaderIter)
        and getattr(obj, "_index_sampler", None) is index_sampler
        and getattr(obj, "_num_yielded", 0) == 0
        for obj in gc.get_objects()
    ):
        return None
    return (
        "the DataLoader given to prepare was iterated before it, no batch taken yet (an "
        "iterator of it is held: InfiniteDataLoader's self.data_iter = "
        "iter(self.train_loader)?): making that iterator drew its workers' base seed from "
        "the global RNG, and the loader prepare returns draws its own at its first batch, "
        "so its shuffle and every draw after it differ from the script's (and batches "
        "taken from that iterator bypass the session). Prepare the DataLoader before "
        "anything iterates it"
    )


class _Skipping:
    """An iterator over the sampler's output from item ``skip`` on. `prime` starts the
    sampler (its per-epoch draw happens then) without loading any data."""

    def __init__(self, source: Any, skip: int) -> None:
        self._source, self._skip = source, skip
        self._rest: Iterator[Any] | None = None

    def prime(self) -> None:
        if self._rest is not None:
            return
        it = iter(self._source)
        for _ in range(self._skip):
            if next(it, _END) is _END:
                break
        first = next(it, _END)
        self._rest = iter(()) if first is _END else itertools.chain([first], it)

    def __iter__(self) -> _Skipping:
        return self

    def __next__(self) -> Any:
        self.prime()
        return next(self._rest)


class Positioned(Sampler):
    """The script's index sampler (of batches, or of samples), starting at ``skip``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.skip = 0
        self.current: _Skipping | None = None

    def __iter__(self) -> _Skipping:
        self.current = _Skipping(self.inner, self.skip)
        return self.current

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.skip)


def _generator_states(generators: list[torch.Generator]) -> list[torch.Tensor]:
    return [torch.get_rng_state(), *(g.get_state() for g in generators)]


def _set_generator_states(generators: list[torch.Generator], states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    for generator, state in zip(generators, states[1:], strict=True):
        generator.set_state(state)


class ScriptLoader:
    """A script's map-style DataLoader that knows its position (epoch, batches handed
    out in it) and continues exactly there after `load_state_dict`.

    Same interface as `ResumableLoader` (``epoch``, ``position``, `reconfigure`,
    `close`), so the ``prefetch`` optimization's torch back end can drive it.
    The script's ``sampler.set_epoch(epoch)`` calls keep working: the copy uses
    the script's sampler object.
    """

    def __init__(self, loader: DataLoader) -> None:
        self.original = loader
        self.dataset = loader.dataset
        self.batch_size = loader.batch_size
        self.sampler = loader.sampler
        self.drop_last = loader.drop_last
        self.settings = {name: getattr(loader, name) for name in SETTINGS if hasattr(loader, name)}
        if not self.settings.get("num_workers"):
            self.settings.pop("prefetch_factor", None)
        # Batches when the loader batches (batch_size or batch_sampler), else samples.
        index_sampler = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
        self._positioned = Positioned(index_sampler)
        self._batched = loader.batch_sampler is not None
        self._generators = [
            g
            for g in (loader.generator, getattr(loader.sampler, "generator", None))
            if isinstance(g, torch.Generator)
        ]
        self.epoch = 0
        self.position = 0
        # Each recent epoch's start, to replay its draws: the RNG states, and whether
        # its pass made a new DataLoader iterator (persistent workers keep one across
        # epochs: then no base seed is drawn).
        self._starts: dict[int, tuple[list[torch.Tensor], bool]] = {}
        # The workers' RNG states (see `worker_rng`): (epoch, batch, worker, state)
        # after each recent batch handed out, by the id of the run's worker it is
        # (a pass's worker m plays the run's worker (m + shift) mod W; batch -1: the
        # state a pass's workers started from); what the next pass's new workers
        # start from (a resume's saved states, and their shift).
        self._stamps: deque[tuple[int, int, int, Any]] = deque(maxlen=STAMPS_KEPT)
        self._shift = 0
        self._start_workers: tuple[dict[int, Any], int] | None = None
        self.inexact_resume: str | None = None  # why a resume would not be exact, if so
        # After a resume mid-epoch: the sampler's epoch (set_epoch) in the pass it goes on with.
        self.resumed_sampler_epoch: int | None = None
        self._loader: DataLoader | None = None
        self._finalizer: weakref.finalize | None = None

    # ------------------------------------------------------------- the copy
    def reconfigure(self, **settings: Any) -> None:
        """Change the copy's DataLoader settings (workers, pinning, prefetch)."""
        self.close()
        self.settings.update(settings)
        if not self.settings.get("num_workers"):
            self.settings.pop("prefetch_factor", None)
            self.settings["persistent_workers"] = False

    @property
    def loader(self) -> DataLoader:
        if self._loader is None:
            sampling = (
                {"batch_sampler": self._positioned}
                if self._batched
                else {"sampler": self._positioned, "batch_size": None}
            )
            settings = dict(self.settings)
            if self._tracks_workers:
                settings["collate_fn"] = Stamping(settings["collate_fn"])
            settings["worker_init_fn"] = ends_with_parent(settings.get("worker_init_fn"))
            self._loader = DataLoader(
                self.dataset,
                generator=self.original.generator,
                **sampling,
                **settings,
            )
            self._finalizer = weakref.finalize(self, _shut_down_workers, self._loader)
        return self._loader

    def close(self) -> None:
        """Shut down the copy's worker processes now."""
        if self._finalizer is not None:
            self._finalizer()
        self._loader = self._finalizer = None

    @property
    def _workers(self) -> int:
        return int(self.settings.get("num_workers") or 0)

    @property
    def _tracks_workers(self) -> bool:
        """Batch i goes to worker i mod W (not with ``in_order=False``)."""
        return self._workers > 0 and self.settings.get("in_order", True)

    # ------------------------------------------------------------ iterating
    def __iter__(self) -> Iterator[Any]:
        """The rest of the current epoch (all of it at position 0). Eager: the epoch's
        random draws happen here, on the calling thread, as the script's loader's do."""
        loader = self.loader
        epoch = self.epoch
        fresh = not (loader.persistent_workers and getattr(loader, "_iterator", None))
        replay = self.position > 0
        if replay and epoch not in self._starts:
            raise RuntimeError(
                f"cannot continue epoch {epoch} at batch {self.position}: the RNG states of "
                "its start were not saved"
            )
        fresh_then = fresh
        if replay:
            now = _generator_states(self._generators)
            states, fresh_then = self._starts[epoch]
            _set_generator_states(self._generators, states)
        else:
            # Persistent workers started again (after a resume) were not new in the run.
            fresh_then = fresh and not (loader.persistent_workers and self._start_workers)
            self._starts = {e: s for e, s in self._starts.items() if e >= epoch - 1}
            self._starts[epoch] = (_generator_states(self._generators), fresh_then)
        # The script's pass made no new iterator (persistent workers): draw no base seed.
        throwaway = fresh and not fresh_then
        if throwaway:
            loader.generator = torch.Generator()
        if fresh and self._tracks_workers:
            self._starting_workers(loader)
        self._positioned.skip = self.position
        try:
            iterator = iter(loader)
            self._positioned.current.prime()
        finally:
            loader.worker_init_fn = ends_with_parent(self.settings.get("worker_init_fn"))
            if throwaway:
                loader.generator = self.original.generator
            if replay:
                _set_generator_states(self._generators, now)
        return self._count(iterator, epoch)

    def _starting_workers(self, loader: DataLoader) -> None:
        """New workers: seeded afresh, or, after a resume, from the saved states."""
        start, self._start_workers = self._start_workers, None
        states, self._shift = start if start is not None else ({}, 0)
        self._stamps.extend((self.epoch, -1, w, state) for w, state in states.items())
        if start is not None:
            loader.worker_init_fn = ends_with_parent(
                WorkerStart(states, self._shift, self.settings.get("worker_init_fn"))
            )

    def _count(self, iterator: Iterator[Any], epoch: int) -> Iterator[Any]:
        for batch in iterator:
            if isinstance(batch, Stamped):  # by the run's worker it plays (`WorkerStart`)
                self._stamps.append((epoch, self.position, batch.worker, batch.state))
                batch = batch.batch
            self.position += 1
            yield batch
        if self.epoch == epoch:
            self._epoch_over()

    def _epoch_over(self) -> None:
        self.epoch += 1
        self.position = 0
        if self._shift and self.settings.get("persistent_workers"):
            # The resumed pass's workers played shifted roles; the next epoch's batch i
            # goes to worker i mod W again: start them afresh, from the states reached.
            self.close()
            self._start_workers = (self.worker_states(self.epoch, 0), 0)

    def worker_states(self, epoch: int, position: int) -> dict[int, Any]:
        """Each of the run's workers' RNG state before batch ``position`` of ``epoch``
        was handed out (a worker missing: seeded afresh at the epoch's start)."""
        persistent = self.settings.get("persistent_workers")
        states = {}
        for e, batch, worker, state in self._stamps:  # oldest first
            if (e, batch) < (epoch, position) and (persistent or e == epoch):
                states[worker] = state
        return states

    def next_epoch(self) -> None:
        """The pass over this epoch was left before its end (a ``break`` in the
        script's loop): the next pass is the next epoch, freshly drawn, as the
        script's own DataLoader's would be."""
        if self._tracks_workers and self.settings.get("persistent_workers"):
            self.inexact_resume = (
                "cannot resume exactly: an epoch was left early (a break) while the "
                "loader's persistent workers had loaded batches ahead, whose random draws "
                "never come back to be saved: a resumed run's workers draw otherwise"
            )
        self._epoch_over()

    def __len__(self) -> int:
        return len(self.original)

    # ---------------------------------------------------------------- state
    def state_dict(self, at: tuple[int, int] | None = None) -> dict[str, Any]:
        """``at``: (epoch, batch) training has reached, when a prefetching loader has
        taken more from this one (its workers' states are saved as of then)."""
        workers = self.worker_states(*(at or (self.epoch, self.position)))
        return {
            "epoch": self.epoch,
            "position": self.position,
            "epoch_starts": [[e, int(f), *s] for e, (s, f) in sorted(self._starts.items())],
            "sampler_epoch": int(getattr(self.sampler, "epoch", 0)),
            "batch_size": self.original.batch_size,
            "workers": self._workers,
            "worker_rng": {w: to_saved(state) for w, state in sorted(workers.items())},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("batch_size", self.original.batch_size)
        if saved != self.original.batch_size:
            raise ValueError(
                f"the checkpoint was saved by a DataLoader of batch size {saved}; this one has "
                f"{self.original.batch_size}: its position (epoch {state['epoch']}, batch "
                f"{state['position']}) would be other samples. Resume with batch size {saved}, "
                "or start afresh in another run folder"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._starts = {
            int(e): (list(states), bool(f)) for e, f, *states in state.get("epoch_starts", [])
        }
        if hasattr(self.sampler, "set_epoch") and "sampler_epoch" in state:
            self.sampler.set_epoch(int(state["sampler_epoch"]))
            # (a pass resumed at its end has no batch left to check it at)
            try:
                within = 0 < self.position < len(self)
            except Exception:  # noqa: BLE001 - a sampler without a length
                within = self.position > 0
            self.resumed_sampler_epoch = int(state["sampler_epoch"]) if within else None
        saved_rng = state.get("worker_rng") or {}
        if saved_rng and state.get("workers") == self._workers and self._tracks_workers:
            # The next pass's worker m gets the batches the run's worker (k + m) mod W had.
            states = {int(w): from_saved(s) for w, s in saved_rng.items()}
            self._start_workers = (states, self.position % self._workers)
            self.close()  # workers already running have the wrong states
