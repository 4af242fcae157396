"""A resumable loader whose position counts the batches training has consumed,
however many the back end and the feeder have loaded ahead."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from ...data import ResumableLoader, ScriptLoader
from .feeder import Feeder


class Backend(Protocol):
    """An input pipeline over a `ResumableLoader`'s dataset, sampler and batch size."""

    name: str

    def iterate(self, epoch: int, start: int) -> Iterator[Any]:
        """The batches of ``epoch`` from batch ``start`` on, in the sampler's order."""
        ...

    def close(self) -> None:
        """Stop worker processes and threads the back end keeps between epochs."""
        ...


class PrefetchLoader:
    """Wraps a back end (and, with ``feeder_depth``, a `Feeder`) as a resumable loader.

    ``state_dict()`` is ``{"epoch", "position"}`` like `ResumableLoader`'s, with
    ``position`` the batches handed to training: batches loaded ahead but not
    consumed when a checkpoint is taken are loaded again after a resume.
    """

    def __init__(
        self,
        inner: ResumableLoader | ScriptLoader,
        backend: Backend,
        device: torch.device,
        feeder_depth: int,
        gate: Callable[[], None] | None = None,
        join: Callable[[], None] | None = None,
    ) -> None:
        self.inner, self.backend = inner, backend
        self.device, self.feeder_depth, self.gate = device, feeder_depth, gate
        self.join = join  # called by the feeder thread when it starts
        self.dataset, self.batch_size, self.sampler = inner.dataset, inner.batch_size, inner.sampler
        self.epoch, self.position = inner.epoch, inner.position

    def __iter__(self) -> Iterator[Any]:
        batches = self.backend.iterate(self.epoch, self.position)
        if self.feeder_depth:
            batches = iter(Feeder(batches, self.device, self.feeder_depth, self.gate, self.join))
        try:
            for batch in batches:
                self.position += 1
                yield batch
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()
        self.next_epoch()

    def next_epoch(self) -> None:
        """The next pass is the next epoch: at this one's end, or when the pass was
        left before it (a ``break`` in the script's loop), as a DataLoader's would be."""
        self.epoch += 1
        self.position = 0

    def __len__(self) -> int:
        return len(self.inner)

    def close(self) -> None:
        self.backend.close()

    def state_dict(self) -> dict[str, Any]:
        # The inner loader's own state too (a ScriptLoader's RNG states of each epoch),
        # with the position training has reached.
        inner = (
            self.inner.state_dict((self.epoch, self.position))  # workers' states then
            if isinstance(self.inner, ScriptLoader)
            else self.inner.state_dict()
        )
        return {**inner, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
