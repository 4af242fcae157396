"""The base of every component's typed config (a leaf module: imports nothing of overlapkit)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Config(BaseModel):
    """A component's config: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    def changed(self) -> dict[str, Any]:
        """Only the fields set to something other than their default, for logs and reports."""
        return self.model_dump(exclude_defaults=True)
