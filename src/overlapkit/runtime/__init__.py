"""The loop and its contracts: events, the optimization base class, the scheduler,
the built-in loop, the custom-loop session and the metrics."""

from .arbitration import POLICIES, ArbitrationPolicy, PriorityPolicy
from .events import Event
from .metrics import PHASES, PhaseClock
from .optimization import (
    COMM_WAIT,
    CombinationError,
    Knob,
    KnobError,
    Optimization,
    Plan,
    Resource,
    WrapStage,
    register_optimization,
)
from .scheduler import Scheduler, SchedulerConfig, resolve_order
from .session import Session
from .state import DataParallel, Shard, State

__all__ = [
    "POLICIES",
    "PHASES",
    "ArbitrationPolicy",
    "CombinationError",
    "DataParallel",
    "Event",
    "Knob",
    "KnobError",
    "Optimization",
    "PhaseClock",
    "Plan",
    "PriorityPolicy",
    "COMM_WAIT",
    "Resource",
    "Scheduler",
    "SchedulerConfig",
    "Session",
    "Shard",
    "State",
    "WrapStage",
    "register_optimization",
    "resolve_order",
]
