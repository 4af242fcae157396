"""TensorFlow: the same scenarios on tf.distribute.MultiWorkerMirroredStrategy.

One process per rank, started by overlapkit's launcher; a custom training loop
with one compiled step per ``strategy.run``; the optimizations that exist on
TensorFlow plug in through their ``tensorflow`` engines (see
`overlapkit.runtime.optimization.engine_for`).
"""

from __future__ import annotations

import os

# Before anything here imports TensorFlow (keras does, at import): its INFO and WARNING
# lines (the coordination service, the profiler's options) went to every run's stderr.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from ...optimizations.prefetch.tfdata_backend import import_tensorflow  # noqa: E402
from ...packages import installed


def tensorflow_missing() -> str | None:
    """Why TensorFlow cannot run here (not installed), or None."""
    if installed("tensorflow"):
        return None
    return (
        "framework: tensorflow needs TensorFlow, which is not installed: "
        "pip install 'overlapkit[tensorflow]'"
    )


def check_gpu_setup(local_ranks: int) -> None:
    """``world.device: cuda`` on TensorFlow: a GPU TensorFlow sees for every rank, or
    `GPUSetupError` (TensorFlow would train on the CPU without a word)."""
    from ...runtime.gpus import GPUFacts, GPUSetupError, check_rank_count

    if GPUFacts.probe().count == 0:  # no device or driver: TensorFlow sees none either
        raise GPUSetupError("world.device is cuda but no CUDA device is visible")
    gpus = import_tensorflow().config.list_physical_devices("GPU")
    if not gpus:
        raise GPUSetupError(
            "world.device is cuda but TensorFlow sees no GPU (is it a CPU-only build? "
            "pip install 'tensorflow[and-cuda]'), or set world.device: cpu"
        )
    check_rank_count(local_ranks, len(gpus))


__all__ = ["check_gpu_setup", "import_tensorflow", "tensorflow_missing"]
