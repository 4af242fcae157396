"""The ``ddp_overlap`` optimization: gradient all-reduce overlapped with backward."""

from .optimization import DDPOverlap
from .profile import SIZE_CLASSES, AllreduceProfile, size_class

__all__ = ["SIZE_CLASSES", "AllreduceProfile", "DDPOverlap", "size_class"]
