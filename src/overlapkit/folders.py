"""Folders named by the time they were made: two runs (or comparisons, or fresh starts)
begun in the same second never share one; the second gets ``-2``, the next ``-3``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path


def stamped(parent: Path, stem: str) -> Path:
    """``parent/stem-YYYYmmdd-HHMMSS``: a name, not yet claimed."""
    return parent / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def _names(path: Path) -> Iterator[Path]:
    """``path``, ``path-2``, ``path-3``..."""
    yield path
    for n in itertools.count(2):
        yield path.with_name(f"{path.name}-{n}")


def unused(path: Path) -> Path:
    """The first of ``path``, ``path-2``... that nothing has yet (for moving a folder
    aside; only one process moves it)."""
    return next(candidate for candidate in _names(path) if not candidate.exists())


def claim(path: Path) -> Path:
    """Create the first of ``path``, ``path-2``... that does not exist, and return it.
    The creation is atomic: a process that picked the same name a moment later gets
    the next."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for candidate in _names(path):
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise AssertionError("unreachable: the names never end")


def new_stamped(parent: Path, stem: str) -> Path:
    """A new, empty folder ``parent/stem-<time>`` (``-2``... when that one exists)."""
    return claim(stamped(parent, stem))
