"""Folders named by the time they were made: two runs (or comparisons, or fresh starts)
begun in the same second never share one; the second gets ``-2``, the next ``-3``."""

from __future__ import annotations

import time
from pathlib import Path


def stamped(parent: Path, stem: str) -> Path:
    """``parent/stem-YYYYmmdd-HHMMSS``: a name, not yet claimed."""
    return parent / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def unused(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``...: a name nothing has yet (for moving a
    folder aside; only one process moves it)."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def claim(path: Path) -> Path:
    """Create ``path``, or ``path-2``, ``path-3``... and return the one created. The
    creation is atomic: a process that picked the same name a moment later gets the next."""
    path.parent.mkdir(parents=True, exist_ok=True)
    candidate, n = path, 1
    while True:
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            n += 1
            candidate = path.with_name(f"{path.name}-{n}")


def new_stamped(parent: Path, stem: str) -> Path:
    """A new, empty folder ``parent/stem-<time>`` (``-2``... when that one exists)."""
    return claim(stamped(parent, stem))
