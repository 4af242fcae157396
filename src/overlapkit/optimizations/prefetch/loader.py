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
        # The global RNGs loading on the feeder thread draws from (see `inexact_resume`).
        self.feeder_draws: list[str] = []

    def __iter__(self) -> Iterator[Any]:
        batches = self.backend.iterate(self.epoch, self.position)
        feeder = None
        if self.feeder_depth:
            feeder = Feeder(batches, self.device, self.feeder_depth, self.gate, self.join)
            batches = iter(feeder)
        try:
            for batch in batches:
                if feeder is not None and not self.feeder_draws:
                    self.feeder_draws = feeder.first_load_draws
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

    @property
    def inexact_resume(self) -> str | None:
        """Why a resume cannot be exact (the session says it when checkpointing): the
        feeder thread loads batches ahead in this process, and loading draws from its
        global RNG (a dataset's random pairs or augmentation without workers), so a
        checkpoint holds draws of batches not yet trained, which a resume makes again
        from there: its batches part from the run never stopped."""
        if not self.feeder_draws:
            return None
        return (
            "cannot resume exactly: loading a batch draws from this process's global RNG "
            f"({', '.join(self.feeder_draws)}: the dataset's __getitem__ or the collate "
            "function, run here when the loader has no workers) on prefetch's feeder "
            "thread, which loads batches ahead of training: a checkpoint holds the draws "
            "of batches not yet trained, and a resumed run loads them with other numbers. "
            "Give prefetch workers (workers=1 or more: each worker's RNG state is "
            "checkpointed with its batches), or intensity 0"
        )

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
