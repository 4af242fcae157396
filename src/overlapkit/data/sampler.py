"""Deterministic sharding across ranks and a loader that knows its position,
so that a resumed run continues with exactly the next batch."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .worker_watch import ends_with_parent


class ShardedSampler(Sampler[int]):
    """One seeded permutation per epoch, dealt to ranks in turn.

    With ``drop_last`` every rank gets the same number of samples (the
    remainder is dropped); without it, shards differ by at most one sample and
    nothing is repeated, which keeps a sharded evaluation exact.
    """

    def __init__(
        self,
        size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        self.size, self.rank, self.world_size = size, rank, world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch = 0
        self.start = 0  # samples of this rank's shard to skip (resume mid-epoch)

    def indices(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
            order = torch.randperm(self.size, generator=generator).tolist()
        else:
            order = list(range(self.size))
        if self.drop_last:
            order = order[: self.size - self.size % self.world_size]
        return order[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices()[self.start :])

    def __len__(self) -> int:
        return len(self.indices()) - self.start

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def _shut_down_workers(loader: DataLoader) -> None:
    """Stop a DataLoader's persistent workers (DataLoader has no public call for it).
    Left to the garbage collector, a worker can miss its stop message and cost 5 s."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


class ResumableLoader:
    """A `DataLoader` over a `ShardedSampler` that counts the batches it hands out.

    ``state_dict()`` is the position (epoch, batches consumed in it); after
    ``load_state_dict`` the next batch is the one an uninterrupted run would
    have seen next. The underlying DataLoader's settings (workers, pinning,
    prefetch) can be changed with `reconfigure`.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        sampler: ShardedSampler,
        **loader_kwargs: Any,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = sampler
        self.loader_kwargs = {"num_workers": 0, **loader_kwargs}
        self.epoch = 0
        self.position = 0
        self._loader: DataLoader | None = None
        self._finalizer: weakref.finalize | None = None
        # DataLoader draws its workers' base seed from this generator each epoch; with
        # the global one, a resumed run would consume the global RNG at another moment.
        self._generator = torch.Generator()

    def reconfigure(self, **loader_kwargs: Any) -> None:
        self.close()
        self.loader_kwargs.update(loader_kwargs)

    @property
    def loader(self) -> DataLoader:
        if self._loader is None:
            init = ends_with_parent(self.loader_kwargs.get("worker_init_fn"))
            self._loader = DataLoader(
                self.dataset,
                batch_size=self.batch_size,
                sampler=self.sampler,
                drop_last=self.sampler.drop_last,
                generator=self._generator,
                **{**self.loader_kwargs, "worker_init_fn": init},
            )
            # The finalizer holds the DataLoader, so the garbage collector cannot take its
            # worker queues apart before the workers are told to stop.
            self._finalizer = weakref.finalize(self, _shut_down_workers, self._loader)
        return self._loader

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.sampler.start = self.position * self.batch_size
        self._generator.manual_seed(self.sampler.seed * 100_003 + self.epoch)
        for batch in self.loader:
            self.position += 1
            yield batch
        self.next_epoch()

    def next_epoch(self) -> None:
        """The next pass is the next epoch: at this one's end, or when the pass was
        left before it (a ``break`` in the script's loop), as a DataLoader's would be."""
        self.epoch += 1
        self.position = 0

    def close(self) -> None:
        """Shut down the DataLoader's persistent worker processes now."""
        if self._finalizer is not None:
            self._finalizer()
        self._loader = self._finalizer = None

    def __len__(self) -> int:
        shard = len(self.sampler.indices())
        return shard // self.batch_size if self.sampler.drop_last else -(-shard // self.batch_size)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
