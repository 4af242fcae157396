"""overlapkit's own warnings, as the command line shows them: one line on stderr
(``overlapkit: warning: ...``), not Python's dump of a file, line and source line."""

from __future__ import annotations

import warnings
from typing import Any


def one_line_warnings() -> None:
    """In this process, format warnings of overlapkit's classes as one line each. Only
    the formatting changes: ``catch_warnings(record=True)`` and filters work as ever."""
    formatted = warnings.formatwarning
    if getattr(formatted, "one_line", False):
        return

    def format_one(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> str:
        if category.__module__.split(".")[0] == "overlapkit":
            return f"overlapkit: warning: {message}\n"
        return formatted(message, category, *args, **kwargs)

    format_one.one_line = True  # type: ignore[attr-defined]
    warnings.formatwarning = format_one
