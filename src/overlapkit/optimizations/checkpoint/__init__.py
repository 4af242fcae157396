"""The ``checkpoint`` optimization: two-phase (snapshot, persist) checkpoints."""

from .optimization import Checkpoint, CheckpointError
from .policy import AutoInterval
from .restore import CheckpointCorruptWarning

__all__ = ["AutoInterval", "Checkpoint", "CheckpointCorruptWarning", "CheckpointError"]
