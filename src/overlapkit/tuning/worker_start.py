"""Where a `tune --workers K` worker process starts: a module light to import (the
tuner's are not: torch, optuna), so that Ctrl-C while the worker imports them, which
reaches every process of the terminal, ends it quietly instead of with a traceback.
Its arguments come pickled, as they would import the tuner as they are read."""

from __future__ import annotations

import pickle
import sys


def start(arguments: bytes) -> None:
    """``runner._worker_process(*arguments)``, once the tuner is imported."""
    try:
        from . import runner

        loaded = pickle.loads(arguments)
    except KeyboardInterrupt:  # the parent says how to continue
        sys.exit(130)
    runner._worker_process(*loaded)
