"""Whether an optional package is installed, without importing it."""

from __future__ import annotations

import importlib.util


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or blocked in sys.modules
        return False
