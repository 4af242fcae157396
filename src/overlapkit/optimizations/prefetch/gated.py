"""The dataset as a back end's workers see it under the ``priority`` policy: a
gate runs before each sample, so a worker (a process or a thread) waits while
the training step needs the cores it would take."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import Dataset


class GatedDataset(Dataset):
    def __init__(self, dataset: Dataset, gate: Callable[[], None]) -> None:
        self.dataset, self.gate = dataset, gate

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        self.gate()
        return self.dataset[index]

    def __getattr__(self, name: str) -> Any:  # the dataset's own attributes
        if name in ("dataset", "gate"):  # not set yet (while unpickling)
            raise AttributeError(name)
        return getattr(self.dataset, name)
