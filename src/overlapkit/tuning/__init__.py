"""Optuna search over the optimizations' knobs (the tuner itself arrives with its issue)."""

from .config import TuneConfig

__all__ = ["TuneConfig"]
