"""The base of every component's typed config (a leaf module: imports nothing of overlapkit)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Config(BaseModel):
    """A component's config: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)
