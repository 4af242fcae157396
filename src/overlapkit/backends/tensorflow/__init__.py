"""TensorFlow: the same scenarios on tf.distribute.MultiWorkerMirroredStrategy.

One process per rank, started by overlapkit's launcher; a custom training loop
with one compiled step per ``strategy.run``; the optimizations that exist on
TensorFlow plug in through their ``tensorflow`` engines (see
`overlapkit.runtime.optimization.engine_for`).
"""

from __future__ import annotations

from ...optimizations.prefetch.tfdata_backend import import_tensorflow
from ...packages import installed


def tensorflow_missing() -> str | None:
    """Why TensorFlow cannot run here (not installed), or None."""
    if installed("tensorflow"):
        return None
    return (
        "framework: tensorflow needs TensorFlow, which is not installed: "
        "pip install 'overlapkit[tensorflow]'"
    )


__all__ = ["import_tensorflow", "tensorflow_missing"]
