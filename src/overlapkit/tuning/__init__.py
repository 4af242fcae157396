"""Optuna search over the optimizations' knobs, the goodput objective, contention
analysis and the report (``overlapkit tune`` and ``overlapkit report``)."""

from .config import TuneConfig


class StudyNotFoundError(LookupError):
    """``overlapkit report`` was pointed at something that holds no study."""


__all__ = ["StudyNotFoundError", "TuneConfig"]
