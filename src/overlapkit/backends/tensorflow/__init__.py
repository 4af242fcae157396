"""TensorFlow: the same scenarios on tf.distribute.MultiWorkerMirroredStrategy.

One process per rank, started by overlapkit's launcher; a custom training loop
with one compiled step per ``strategy.run``; the optimizations that exist on
TensorFlow plug in through their ``tensorflow`` engines (see `engine`).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any


def tensorflow_missing() -> str | None:
    """Why TensorFlow cannot run here (not installed), or None."""
    try:
        found = importlib.util.find_spec("tensorflow") is not None
    except (ImportError, ValueError):
        found = False
    return (
        None
        if found
        else (
            "framework: tensorflow needs TensorFlow, which is not installed: "
            "pip install 'overlapkit[tensorflow]'"
        )
    )


def import_tensorflow() -> Any:
    """TensorFlow, imported quietly (its C++ start-up chatter goes to stderr)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    return tf
