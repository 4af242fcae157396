"""A plugin that the test Ray cluster's machines are not told of (their
OVERLAPKIT_PLUGINS names toy_plugins only): a run under --ray passes the driver's
OVERLAPKIT_PLUGINS on to each machine."""

from __future__ import annotations

from overlapkit.runtime import Optimization, register_optimization


@register_optimization
class ToyElsewhere(Optimization):
    """Does nothing: a name that only the driver's plugins know."""

    name = "toy_elsewhere"
