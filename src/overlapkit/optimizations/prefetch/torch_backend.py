"""The ``torch`` back end: PyTorch's DataLoader with worker processes."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from ...data import ResumableLoader


class TorchBackend:
    name = "torch"

    def __init__(
        self, inner: ResumableLoader, workers: int, depth: int, pin: bool, persistent: bool
    ) -> None:
        self.inner = inner
        settings: dict[str, Any] = {"num_workers": workers, "pin_memory": pin}
        if workers:
            # DataLoader keeps prefetch_factor batches per worker in flight.
            settings["prefetch_factor"] = max(1, math.ceil(depth / workers))
            settings["persistent_workers"] = persistent
        inner.reconfigure(**settings)

    def iterate(self, epoch: int, start: int) -> Iterator[Any]:
        self.inner.epoch, self.inner.position = epoch, start
        return iter(self.inner)

    def close(self) -> None:
        self.inner.close()
