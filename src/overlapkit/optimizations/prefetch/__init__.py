"""The ``prefetch`` optimization: input pipelines overlapped with compute."""

from .feeder import Feeder
from .loader import PrefetchLoader
from .optimization import BACKENDS, Prefetch, PrefetchError

__all__ = ["BACKENDS", "Feeder", "Prefetch", "PrefetchError", "PrefetchLoader"]
