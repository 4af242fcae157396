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

import itertools
import weakref
from collections.abc import Iterator
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

from .sampler import ShardedSampler, _shut_down_workers

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


def resume_problem(loader: Any) -> str | None:
    """Why ``loader`` cannot resume exactly mid-epoch (None: it can)."""
    if hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict"):
        return None
    if not isinstance(loader, DataLoader):
        return (
            f"the loader ({type(loader).__name__}) has no state_dict: a resumed run starts "
            "its epoch again at batch 0. Pass a map-style torch DataLoader, or give the loader "
            "state_dict/load_state_dict"
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
            self._loader = DataLoader(
                self.dataset,
                generator=self.original.generator,
                **sampling,
                **self.settings,
            )
            self._finalizer = weakref.finalize(self, _shut_down_workers, self._loader)
        return self._loader

    def close(self) -> None:
        """Shut down the copy's worker processes now."""
        if self._finalizer is not None:
            self._finalizer()
        self._loader = self._finalizer = None

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
            self._starts = {e: s for e, s in self._starts.items() if e >= epoch - 1}
            self._starts[epoch] = (_generator_states(self._generators), fresh)
        # The script's pass made no new iterator (persistent workers): draw no base seed.
        throwaway = fresh and not fresh_then
        if throwaway:
            loader.generator = torch.Generator()
        self._positioned.skip = self.position
        try:
            iterator = iter(loader)
            self._positioned.current.prime()
        finally:
            if throwaway:
                loader.generator = self.original.generator
            if replay:
                _set_generator_states(self._generators, now)
        return self._count(iterator, epoch)

    def _count(self, iterator: Iterator[Any], epoch: int) -> Iterator[Any]:
        for batch in iterator:
            self.position += 1
            yield batch
        if self.epoch == epoch:
            self.epoch += 1
            self.position = 0

    def next_epoch(self) -> None:
        """The pass over this epoch was left before its end (a ``break`` in the
        script's loop): the next pass is the next epoch, freshly drawn, as the
        script's own DataLoader's would be."""
        self.epoch += 1
        self.position = 0

    def __len__(self) -> int:
        return len(self.original)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "epoch_starts": [[e, int(f), *s] for e, (s, f) in sorted(self._starts.items())],
            "sampler_epoch": int(getattr(self.sampler, "epoch", 0)),
            "batch_size": self.original.batch_size,
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
