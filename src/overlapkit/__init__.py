"""overlapkit: a composable training runtime that overlaps gradient communication,
checkpointing, input loading and pipeline stages, and measures where more
overlap stops paying off."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import lazy_exports

__version__ = "0.1.0"

# Each name is imported from its module on first use, so that importing a module of
# the package that needs no torch (`launch.ray_nodes`, which every Ray actor of a run
# imports) does not import torch for these.
_EXPORTS = {
    "Demand": ".runtime",
    "Event": ".runtime",
    "Knob": ".runtime",
    "LoopWarning": ".runtime",
    "Optimization": ".runtime",
    "Resource": ".runtime",
    "Session": ".runtime",
    "Start": ".runtime",
    "register_optimization": ".runtime",
    "get_optimization": ".optimizations",
    "registered_optimizations": ".optimizations",
}

__all__ = [
    "Demand",
    "Event",
    "Knob",
    "LoopWarning",
    "Optimization",
    "Resource",
    "Session",
    "Start",
    "get_optimization",
    "register_optimization",
    "registered_optimizations",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .optimizations import get_optimization, registered_optimizations
    from .runtime import (
        Demand,
        Event,
        Knob,
        LoopWarning,
        Optimization,
        Resource,
        Session,
        Start,
        register_optimization,
    )
