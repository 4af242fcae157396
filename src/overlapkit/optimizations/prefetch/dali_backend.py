"""The ``dali`` back end: an NVIDIA DALI pipeline over the same dataset.

An external source calls the dataset's ``__getitem__`` per sample, in
``workers`` worker processes (DALI's parallel external source) or, without
workers, on the thread that runs the pipeline; ``depth`` is the pipeline's
prefetch queue. On a GPU the pipeline puts batches on the device itself; on a
CPU (``device_id=None``) it runs CPU-only. Batches come out through DALI's
PyTorch iterator.

One pipeline serves consecutive epochs: DALI's epoch ``k`` of a pipeline
built at (epoch ``e``, batch ``s``) is epoch ``e + k``, from batch ``s`` in
its first one. Asked for anything else (after a resume, or an epoch left
unfinished), the back end builds a new pipeline.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

from ...data import ResumableLoader
from .extras import require
from .samples import SampleLayout, epoch_indices


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """DALI prints a libcuda message to stdout on machines without a GPU:
    send file descriptor 1 to stderr meanwhile, so stdout stays parseable."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def import_dali() -> Any:
    require("dali")
    with stdout_to_stderr():
        import nvidia.dali as dali
        import nvidia.dali.plugin.pytorch  # noqa: F401

    return dali


class _Samples:
    """DALI's per-sample source: picklable, so worker processes can run it."""

    def __init__(self, inner: ResumableLoader, layout: SampleLayout, epoch: int, start: int):
        self.dataset, self.sampler, self.batch_size = inner.dataset, inner.sampler, inner.batch_size
        self.layout, self.epoch, self.skip = layout, epoch, start * inner.batch_size
        self._cached: tuple[int, list[int]] = (-1, [])

    def __call__(self, info: Any) -> list[Any]:
        epoch = self.epoch + info.epoch_idx
        if self._cached[0] != epoch:
            self._cached = (epoch, epoch_indices(self.sampler, self.batch_size, epoch))
        indices = self._cached[1]
        position = info.idx_in_epoch + (self.skip if info.epoch_idx == 0 else 0)
        if position < len(indices):
            return self.layout.flatten(self.dataset[indices[position]])
        if position < -(-len(indices) // self.batch_size) * self.batch_size:
            # DALI drops a batch the source cannot fill: fill the short last one with
            # zeros, which `DaliBackend.iterate` cuts off again.
            return self.layout.padding()
        raise StopIteration


class DaliBackend:
    name = "dali"

    def __init__(
        self, inner: ResumableLoader, workers: int, depth: int, device: torch.device
    ) -> None:
        self.dali = import_dali()
        self.inner, self.workers, self.depth, self.device = inner, workers, depth, device
        self.layout = SampleLayout.probe(inner)
        self.names = [f"leaf{i}" for i in range(len(self.layout.dtypes))]
        self._iterator: Any = None
        self._next: tuple[int, int] | None = None  # what the current pipeline yields next

    def _build(self, epoch: int, start: int) -> Any:
        dali = self.dali
        from nvidia.dali.plugin.base_iterator import LastBatchPolicy
        from nvidia.dali.plugin.pytorch import DALIGenericIterator

        on_gpu = self.device.type == "cuda"
        pipe = dali.Pipeline(
            batch_size=self.inner.batch_size,
            num_threads=1,
            device_id=(self.device.index or 0) if on_gpu else None,
            prefetch_queue_depth=max(1, self.depth),
            exec_async=self.depth > 0,
            exec_pipelined=self.depth > 0,
            py_num_workers=max(1, self.workers),
            # forking after CUDA is initialised is unsafe: spawn (and pickle the source) then
            py_start_method="spawn" if on_gpu else "fork",
        )
        parallel = {"parallel": True, "prefetch_queue_depth": max(1, self.depth)}
        with pipe, stdout_to_stderr():
            leaves = dali.fn.external_source(
                source=_Samples(self.inner, self.layout, epoch, start),
                num_outputs=len(self.names),
                batch=False,
                dtype=[dali.types.to_dali_type(d) for d in self.layout.dtypes],
                **(parallel if self.workers else {}),
            )
            pipe.set_outputs(*[leaf.gpu() for leaf in leaves] if on_gpu else leaves)
            pipe.build()
            policy = (
                LastBatchPolicy.DROP if self.inner.sampler.drop_last else LastBatchPolicy.PARTIAL
            )
            return DALIGenericIterator(pipe, self.names, last_batch_policy=policy, auto_reset=True)

    def iterate(self, epoch: int, start: int) -> Iterator[Any]:
        if self._iterator is None or self._next != (epoch, start):
            self.close()
            self._iterator = self._build(epoch, start)
        self._next = None  # left unfinished, the pipeline is mid-epoch: build anew
        samples = len(epoch_indices(self.inner.sampler, self.inner.batch_size, epoch))
        last = -(-samples // self.inner.batch_size) - 1 - start  # the short one, if any
        for i, outputs in enumerate(self._iterator):
            (batch,) = outputs  # one pipeline
            leaves = [batch[name] for name in self.names]
            if i == last and samples % self.inner.batch_size:
                leaves = [leaf[: samples % self.inner.batch_size] for leaf in leaves]
            yield self.layout.batch(leaves)
        self._next = (epoch + 1, 0)

    def close(self) -> None:
        self._iterator, self._next = None, None  # the pipeline's worker processes go with it
