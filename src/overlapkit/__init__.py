"""overlapkit: a composable training runtime that overlaps gradient communication,
checkpointing, input loading and pipeline stages, and measures where more
overlap stops paying off."""

from .optimizations import get_optimization, registered_optimizations
from .runtime import Event, Knob, Optimization, Resource, Session, register_optimization

__version__ = "0.1.0"

__all__ = [
    "Event",
    "Knob",
    "Optimization",
    "Resource",
    "Session",
    "get_optimization",
    "register_optimization",
    "registered_optimizations",
]
