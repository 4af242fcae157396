"""Deterministic sharding across ranks and a loader that knows its position,
so that a resumed run continues with exactly the next batch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


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
        # DataLoader draws its workers' base seed from this generator each epoch; with
        # the global one, a resumed run would consume the global RNG at another moment.
        self._generator = torch.Generator()

    def reconfigure(self, **loader_kwargs: Any) -> None:
        self.loader_kwargs.update(loader_kwargs)
        self._loader = None

    @property
    def loader(self) -> DataLoader:
        if self._loader is None:
            self._loader = DataLoader(
                self.dataset,
                batch_size=self.batch_size,
                sampler=self.sampler,
                drop_last=self.sampler.drop_last,
                generator=self._generator,
                **self.loader_kwargs,
            )
        return self._loader

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.sampler.start = self.position * self.batch_size
        self._generator.manual_seed(self.sampler.seed * 100_003 + self.epoch)
        for batch in self.loader:
            self.position += 1
            yield batch
        self.epoch += 1
        self.position = 0

    def __len__(self) -> int:
        shard = len(self.sampler.indices())
        return shard // self.batch_size if self.sampler.drop_last else -(-shard // self.batch_size)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
