"""Durable, atomic writes: a reader sees the old file or the whole new one, never a part."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[int], T], direct: bool = False) -> T:
    """Call ``write(fd)`` on a temporary file beside ``path``, fsync it, rename it over
    ``path`` and fsync the folder; return what ``write`` returned. On any error the
    temporary file is removed and ``path`` is untouched.

    ``direct`` opens the file with O_DIRECT where the file system allows it
    (``write`` must then write aligned blocks) and silently without elsewhere."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = _open_for_writing(tmp, direct)
        try:
            result = write(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return result


def _open_for_writing(path: Path, direct: bool) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError:  # e.g. tmpfs: EINVAL
            pass
    return os.open(path, flags, 0o644)


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` atomically and durably (see `atomic_write`)."""

    import torch  # here: the Ray actor that mirrors checkpoint folders imports no torch

    def save(fd: int) -> None:
        with os.fdopen(os.dup(fd), "wb") as f:
            torch.save(obj, f)

    atomic_write(path, save)
