"""The scheduler's policies by name (what ``scheduler.policy`` and the tuner choose from)."""

from __future__ import annotations

from .arbitration import ArbitrationPolicy, PriorityPolicy
from .partition import PartitionPolicy

POLICIES: dict[str, type[ArbitrationPolicy]] = {
    policy.name: policy for policy in (ArbitrationPolicy, PriorityPolicy, PartitionPolicy)
}
