"""``checkpoint`` on TensorFlow: the optimization itself, in overlapkit's format.

Its hooks need only the loop's `State`: ``capture`` (TensorFlow's loop gives
zero-copy views of the variables), ``restore``, the phase clock and the
control-plane process group. Snapshot, persist, the manifest, crash safety and
resume are the same code as on torch (see `backends.tensorflow.loop` for when
the snapshot's copy is waited for).
"""

from __future__ import annotations

from .optimization import Checkpoint


def engine(optimization: Checkpoint) -> Checkpoint:
    return optimization
