"""The ``tfdata`` back end: a tf.data pipeline over the same dataset.

The sampler's indices for the epoch, batched, are the pipeline's source; a
parallel map loads each batch with the dataset's own ``__getitem__`` and
stacks it, ``workers`` batches at a time, like DataLoader workers (through
``tf.numpy_function``, so a Python dataset holds the GIL while it runs: loading
that releases it, like file reads, runs in parallel, pure-Python decoding does
not; one call per batch rather than per sample saves ~6 ms a batch of 32);
``prefetch`` keeps ``depth`` batches ahead (or AUTOTUNE). Batches reach
torch through DLPack, without a copy. TensorFlow stays on the host even on a
GPU machine: there it would reserve nearly all the memory torch trains in, and
its device copies would run on streams torch does not wait for; the prefetch
feeder copies each batch to the GPU on its own side stream instead.

Unless ``autotune`` is set, tf.data's own rewrites (injected prefetch,
automatic map parallelism) are off and its thread pool is ``workers + 1``
threads, so the knobs mean what they say and intensity 0 loads nothing ahead.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from ...data import ResumableLoader
from .extras import require
from .samples import SampleLayout, epoch_indices

# What TensorFlow's import writes to stderr before its logging starts, whatever
# TF_CPP_MIN_LOG_LEVEL says: four lines a process, eight a run of two ranks.
START_UP_CHATTER = ("before absl::InitializeLog() is called", "oneDNN custom operations are on")


def import_tensorflow() -> Any:
    require("tfdata")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter
    if "tensorflow" in sys.modules:
        return sys.modules["tensorflow"]
    with _stderr_without(START_UP_CHATTER):
        import tensorflow as tf

    return tf


# Copies its input to its output but for the lines holding any of its arguments.
_FILTER = (
    "import sys\n"
    "chatter = [words.encode() for words in sys.argv[1:]]\n"
    "for line in sys.stdin.buffer:\n"
    "    if not any(words in line for words in chatter):\n"
    "        sys.stdout.buffer.write(line)\n"
    "        sys.stdout.buffer.flush()\n"
)


@contextmanager
def _stderr_without(chatter: tuple[str, ...]) -> Iterator[None]:
    """Within: what the process writes to stderr (file descriptor 2, as C++ code does)
    passes, line by line, through a small filter process that drops the lines holding
    any of ``chatter``. It outlives a crash of this one (a fatal log line, then abort)
    and writes out what was said before it, and it needs no GIL of ours to read."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (AttributeError, OSError):  # no stderr (None, or its descriptor closed)
        yield
        return
    read, write = os.pipe()
    try:
        command = [sys.executable, "-I", "-S", "-c", _FILTER, *chatter]
        filtering = subprocess.Popen(command, stdin=read, stdout=saved, close_fds=True)
    except (OSError, ValueError):  # no interpreter to start: unfiltered
        filtering = None
    os.close(read)
    if filtering is None:
        os.close(write)
        os.close(saved)
        yield
        return
    os.dup2(write, 2)
    os.close(write)
    try:
        yield
    finally:
        with contextlib.suppress(AttributeError, OSError):
            sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer gone: the filter reads to its end
        os.close(saved)
        with contextlib.suppress(subprocess.TimeoutExpired):
            filtering.wait(timeout=10)


def load_overlapped(
    tf: Any,
    dataset: Any,
    load: Any,
    workers: int,
    depth: int,
    autotune: bool,
    device: str | None = None,
    device_depth: int = 0,
) -> Any:
    """``dataset`` mapped by ``load`` as the prefetch knobs say: ``workers`` calls at
    once (0: on the pipeline's own thread), ``depth`` batches ahead (0: none), and on
    ``device`` ``device_depth`` batches already there (TensorFlow's own training loop;
    the torch back end below keeps TensorFlow on the host); or tf.data's ``autotune``.
    Without autotune tf.data's own rewrites (injected prefetch, map parallelism) stay
    off, so the knobs mean what they say and depth 0 loads nothing ahead."""
    if autotune:
        dataset = dataset.map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    elif workers:
        dataset = dataset.map(load, num_parallel_calls=workers, deterministic=True)
    else:
        dataset = dataset.map(load)
    if autotune or depth:
        dataset = dataset.prefetch(tf.data.AUTOTUNE if autotune else depth)
    if device is not None and device_depth:
        dataset = dataset.apply(
            tf.data.experimental.prefetch_to_device(device, buffer_size=device_depth)
        )
    options = tf.data.Options()
    options.deterministic = True
    options.autotune.enabled = autotune
    if not autotune:
        options.experimental_optimization.apply_default_optimizations = False
        options.threading.private_threadpool_size = workers + 1
    return dataset.with_options(options)


class TfDataBackend:
    name = "tfdata"

    def __init__(
        self,
        inner: ResumableLoader,
        workers: int,
        depth: int,
        autotune: bool,
    ) -> None:
        self.tf = import_tensorflow()
        self.inner, self.workers, self.depth, self.autotune = inner, workers, depth, autotune
        self.layout = SampleLayout.probe(inner)
        try:  # on the host only (see the module's note)
            self.tf.config.set_visible_devices([], "GPU")
        except RuntimeError:  # this process already started TensorFlow on a GPU
            pass

    def _load(self, indices: np.ndarray) -> list[np.ndarray]:
        samples = [self.layout.flatten(self.inner.dataset[int(i)]) for i in indices]
        return [np.stack(leaves) for leaves in zip(*samples, strict=True)]

    def _map(self, indices: Any) -> tuple[Any, ...]:
        tf = self.tf
        dtypes = [tf.as_dtype(d) for d in self.layout.dtypes]
        leaves = tf.numpy_function(self._load, [indices], dtypes, stateful=False)
        for leaf, shape in zip(leaves, self.layout.shapes, strict=True):
            leaf.set_shape((None, *shape))
        return tuple(leaves)

    def pipeline(self, epoch: int, start: int) -> Any:
        tf = self.tf
        batch_size = self.inner.batch_size
        indices = epoch_indices(self.inner.sampler, batch_size, epoch)[start * batch_size :]
        dataset = tf.data.Dataset.from_tensor_slices(np.asarray(indices, dtype=np.int64))
        dataset = dataset.batch(batch_size, drop_remainder=self.inner.sampler.drop_last)
        load = tf.autograph.experimental.do_not_convert(self._map)
        return load_overlapped(
            tf,
            dataset,
            load,
            self.workers,
            self.depth,
            self.autotune,
        )

    def iterate(self, epoch: int, start: int) -> Iterator[Any]:
        for leaves in self.pipeline(epoch, start):
            yield self.layout.batch([torch.from_dlpack(leaf) for leaf in leaves])

    def close(self) -> None:
        """Each epoch's pipeline ends with its iteration: nothing is kept."""
