"""The ``tune`` section of a scenario."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..config import Config


class TuneConfig(Config):
    trials: int = Field(40, ge=1)
    objective: Literal["throughput", "goodput", "both"] = "throughput"
    mtbf_hours: float = Field(24.0, gt=0)
    storage: str | None = None  # an Optuna storage URL; None = SQLite in the run folder
    study: str | None = None
