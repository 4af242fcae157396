"""The ``prefetch`` optimization: input pipelines overlapped with compute."""

from .extras import MissingDependencyError
from .feeder import Feeder
from .loader import PrefetchLoader
from .optimization import BACKENDS, Prefetch, PrefetchError

__all__ = [
    "BACKENDS",
    "Feeder",
    "MissingDependencyError",
    "Prefetch",
    "PrefetchError",
    "PrefetchLoader",
]
