"""The loop and its contracts: events, the optimization base class, the scheduler,
the built-in loop, the custom-loop session and the metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

# Each name is imported from its module on first use: a module of this package that
# needs no torch (`report`'s live step log, `hardware`'s names, read by the Ray actor
# on each machine) can then be imported without torch.
_EXPORTS = {
    "POLICIES": ".policies",
    "PartitionPolicy": ".partition",
    "ArbitrationPolicy": ".arbitration",
    "PriorityPolicy": ".arbitration",
    "Event": ".events",
    "PHASES": ".metrics",
    "PhaseClock": ".metrics",
    "COMM_WAIT": ".optimization",
    "CombinationError": ".optimization",
    "Demand": ".optimization",
    "Knob": ".optimization",
    "KnobError": ".optimization",
    "Optimization": ".optimization",
    "Plan": ".optimization",
    "Resource": ".optimization",
    "WrapStage": ".optimization",
    "register_optimization": ".optimization",
    "Scheduler": ".scheduler",
    "SchedulerConfig": ".scheduler",
    "resolve_order": ".scheduler",
    "Session": ".session",
    "LoopWarning": ".script",
    "Start": ".script",
    "DDPView": ".gradsync",
    "DataParallel": ".state",
    "Shard": ".state",
    "State": ".state",
}

__all__ = [
    "POLICIES",
    "PHASES",
    "ArbitrationPolicy",
    "CombinationError",
    "DDPView",
    "DataParallel",
    "Demand",
    "Event",
    "Knob",
    "KnobError",
    "LoopWarning",
    "Optimization",
    "PartitionPolicy",
    "PhaseClock",
    "Plan",
    "PriorityPolicy",
    "COMM_WAIT",
    "Resource",
    "Scheduler",
    "SchedulerConfig",
    "Session",
    "Shard",
    "Start",
    "State",
    "WrapStage",
    "register_optimization",
    "resolve_order",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .arbitration import ArbitrationPolicy, PriorityPolicy
    from .events import Event
    from .gradsync import DDPView
    from .metrics import PHASES, PhaseClock
    from .optimization import (
        COMM_WAIT,
        CombinationError,
        Demand,
        Knob,
        KnobError,
        Optimization,
        Plan,
        Resource,
        WrapStage,
        register_optimization,
    )
    from .partition import PartitionPolicy
    from .policies import POLICIES
    from .scheduler import Scheduler, SchedulerConfig, resolve_order
    from .script import LoopWarning, Start
    from .session import Session
    from .state import DataParallel, Shard, State
