"""overlapkit's own warnings, as the command line shows them: one line on stderr
(``overlapkit: warning: ...``), not Python's dump of a file, line and source line."""

from __future__ import annotations

import sys
import warnings
from typing import Any


def one_line_warnings() -> None:
    """In this process, show warnings of overlapkit's classes as one line each."""
    shown = warnings.showwarning
    if getattr(shown, "one_line", False):
        return

    def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        if category.__module__.startswith("overlapkit."):
            print(f"overlapkit: warning: {message}", file=sys.stderr, flush=True)
        else:
            shown(message, category, *args, **kwargs)

    show.one_line = True  # type: ignore[attr-defined]
    warnings.showwarning = show
