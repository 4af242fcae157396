"""Folders named by the time they were made: two runs (or comparisons, or fresh starts)
begun in the same second never share one; the second gets ``-2``, the next ``-3``."""

from __future__ import annotations

import fcntl
import itertools
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# In a run folder (and in an absolute checkpoint.dir outside it, which several run
# folders may share): held by the run's launcher while it runs (see `held`).
LOCK = ".lock"
ANOTHER_OUT = "name another folder with --out"  # the way out for a run folder in use


class FolderInUseError(ValueError):
    """Another run holds the run folder (or its checkpoint folder)."""


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


@contextmanager
def held(folder: Path, way_out: str = ANOTHER_OUT) -> Iterator[None]:
    """Hold ``folder``'s lock (`LOCK`, with this process's id in it) while the block
    runs; `FolderInUseError` (saying ``way_out``) when another run holds it. An OS
    lock (flock): it goes with the process however that ends, so a killed run leaves
    none behind."""
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _lock(fd, folder, way_out)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)


def check_free(folder: Path, way_out: str = ANOTHER_OUT) -> None:
    """Raise `FolderInUseError` when a run holds ``folder`` now (creating nothing)."""
    try:
        fd = os.open(folder / LOCK, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        _lock(fd, folder, way_out)
    finally:
        os.close(fd)  # and with it the lock, if taken


def _lock(fd: int, folder: Path, way_out: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = os.pread(fd, 20, 0).decode(errors="replace").strip()
        raise FolderInUseError(
            f"{folder} is in use by another run{f' (pid {pid})' if pid else ''}: two runs "
            f"in one folder would write over each other's checkpoints and results. Let it "
            f"finish or stop it, or {way_out}"
        ) from None


def nearest_existing(path: Path) -> Path | None:
    """``path`` or the nearest folder above it that exists (``..`` resolved first:
    ``run/../x`` is ``x``, though ``run`` does not exist yet); None: none does."""
    resolved = path.resolve()
    return next((place for place in (resolved, *resolved.parents) if place.exists()), None)
