"""Optuna search over the optimizations' knobs, the goodput objective, contention
analysis and the report (``overlapkit tune`` and ``overlapkit report``)."""

from .config import TuneConfig


class TuneError(ValueError):
    """``overlapkit tune`` or ``report`` was given something it cannot use (no study
    there, a study of another kind, a bad worker count)."""


__all__ = ["TuneError", "TuneConfig"]
