"""The input pipelines: the scenario's own datasets, read through tf.data.

Training: this rank's shard in the sampler's order (the same samples, in the
same order, as the torch loop reads), batched, loaded by the dataset's own
``__getitem__`` in a map, one batch per call; images turned channels-last
there. ``InputPlan`` says how much of it overlaps the step (the ``prefetch``
optimization's engine sets it; without one, every batch is loaded when the
step asks for it). The pipeline starts at any batch, which is what resume needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...data import ResumableLoader
from ...optimizations.prefetch.samples import SampleLayout, epoch_indices
from ...optimizations.prefetch.tfdata_backend import load_overlapped


@dataclass(frozen=True)
class InputPlan:
    """How the training pipeline overlaps the step: ``workers`` batches loaded at once
    (0: on the pipeline's own thread), ``depth`` batches ahead (0: none), ``device_depth``
    batches already on the GPU (``prefetch_to_device``), or tf.data's ``autotune``."""

    workers: int = 0
    depth: int = 0
    device_depth: int = 0
    autotune: bool = False


class Batches:
    """Loads batches of ``loader``'s dataset as NumPy arrays, channels-last images."""

    def __init__(self, loader: ResumableLoader) -> None:
        self.loader = loader
        self.layout = SampleLayout.probe(loader)
        if len(self.layout.shapes) != 2:
            raise TypeError("the TensorFlow loop reads (input, target) samples")
        self.images = len(self.layout.shapes[0]) == 3

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return self.layout.shapes[0]

    def load(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        samples = [self.layout.flatten(self.loader.dataset[int(i)]) for i in indices]
        inputs, targets = (np.stack(leaves) for leaves in zip(*samples, strict=True))
        if self.images:
            inputs = np.ascontiguousarray(inputs.transpose(0, 2, 3, 1))
        if inputs.dtype == np.int64:
            inputs = inputs.astype(np.int32)
        return inputs, targets.astype(np.int64)

    def _map(self, tf: Any) -> Any:
        shape = self.layout.shapes[0]
        shape = (*shape[1:], shape[0]) if self.images else shape
        in_dtype = np.int32 if self.layout.dtypes[0] == np.int64 else self.layout.dtypes[0]

        @tf.autograph.experimental.do_not_convert
        def load(indices: Any) -> tuple[Any, Any]:
            inputs, targets = tf.numpy_function(
                self.load, [indices], [tf.as_dtype(in_dtype), tf.int64], stateful=False
            )
            inputs.set_shape((None, *shape))
            targets.set_shape((None,))
            return inputs, targets

        return load

    def train_indices(self, steps: int) -> np.ndarray:
        """The first ``steps`` batches' sample indices, epoch after epoch."""
        sampler, batch_size = self.loader.sampler, self.loader.batch_size
        chunks, batches, epoch = [], 0, 0
        while batches < steps:
            indices = epoch_indices(sampler, batch_size, epoch)
            whole = len(indices) // batch_size
            if whole == 0:
                raise ValueError("this rank's shard holds less than one batch")
            chunks.append(np.asarray(indices[: whole * batch_size], dtype=np.int64))
            batches += whole
            epoch += 1
        return np.concatenate(chunks)[: steps * batch_size]

    def train(self, tf: Any, steps: int, start: int, plan: InputPlan, device: str | None) -> Any:
        """Batches ``start`` to ``steps`` - 1 of this rank's shard."""
        batch_size = self.loader.batch_size
        indices = self.train_indices(steps)[start * batch_size :]
        dataset = tf.data.Dataset.from_tensor_slices(indices).batch(batch_size)
        return load_overlapped(
            tf,
            dataset,
            self._map(tf),
            plan.workers,
            plan.depth,
            plan.autotune,
            device=device,
            device_depth=plan.device_depth,
        )

    def in_order(self, tf: Any) -> Any:
        """Every batch of the sampler's shard, in order (evaluation)."""
        indices = np.asarray(self.loader.sampler.indices(), dtype=np.int64)
        dataset = tf.data.Dataset.from_tensor_slices(indices).batch(self.loader.batch_size)
        return dataset.map(self._map(tf))
