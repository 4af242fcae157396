"""What the tf.data and DALI back ends share: the sampler's order for an epoch,
and a dataset's samples as flat lists of NumPy arrays (what both pipelines
carry) and back into the structure PyTorch's collate would give.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from ...data import ResumableLoader, ShardedSampler


def epoch_indices(sampler: ShardedSampler, batch_size: int, epoch: int) -> list[int]:
    """The sample indices of ``epoch`` for this rank, in order, whole batches only
    when the sampler drops the last partial batch."""
    sampler = copy.copy(sampler)  # the loader's own sampler keeps its epoch
    sampler.set_epoch(epoch)
    indices = sampler.indices()
    if sampler.drop_last:
        indices = indices[: len(indices) - len(indices) % batch_size]
    return indices


def _as_array(leaf: Any) -> np.ndarray:
    if isinstance(leaf, torch.Tensor):
        return leaf.numpy(force=True)
    return np.asarray(leaf)  # int -> int64, float -> float64, bool -> bool: as collate does


@dataclass(frozen=True)
class SampleLayout:
    """The nesting, dtypes and shapes of one sample, from a probe of the dataset."""

    spec: pytree.TreeSpec
    dtypes: tuple[np.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def probe(cls, loader: ResumableLoader) -> SampleLayout:
        first = epoch_indices(loader.sampler, loader.batch_size, 0)[0]
        leaves, spec = pytree.tree_flatten(loader.dataset[first])
        arrays = [_as_array(leaf) for leaf in leaves]
        return cls(spec, tuple(a.dtype for a in arrays), tuple(a.shape for a in arrays))

    def flatten(self, sample: Any) -> list[np.ndarray]:
        leaves, spec = pytree.tree_flatten(sample)
        if spec != self.spec:
            raise TypeError(f"samples differ in structure: {spec} after {self.spec}")
        return [_as_array(leaf) for leaf in leaves]

    def padding(self) -> list[np.ndarray]:
        """A sample of zeros in this layout: what fills a batch the data cannot."""
        return [
            np.zeros(shape, dtype) for dtype, shape in zip(self.dtypes, self.shapes, strict=True)
        ]

    def batch(self, leaves: list[torch.Tensor]) -> Any:
        """A batch of flat leaves (each stacked along dim 0) in the sample's nesting."""
        return pytree.tree_unflatten(leaves, self.spec)
