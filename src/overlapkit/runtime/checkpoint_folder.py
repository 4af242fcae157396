"""A checkpoint folder's layout (its manifest, its step folders), and a copy of
another machine's checkpoint folder, kept up to date while it grows. Torch-free:
the Ray actor on each machine reads its folder with it.

A run on a cluster writes each machine's checkpoints to that machine's disk; the
driver keeps a mirror of each, so that a run whose machine, driver or ranks are
lost resumes from the newest checkpoint that reached it. The manifest says which
step folders are complete: the mirror fetches the ones it lacks, moves each into
place whole, then replaces its manifest (atomically), then removes the step
folders the manifest no longer lists. Killed at any moment, its manifest names
only complete step folders.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .persist import atomic_write

MANIFEST = "manifest.json"  # the complete checkpoints of a checkpoint folder


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def write_json(path: Path, document: Any) -> None:
    """Durably and atomically (see `atomic_write`)."""
    data = memoryview(json.dumps(document, indent=1).encode())

    def write(fd: int) -> None:
        view = data
        while view:
            view = view[os.write(fd, view) :]

    atomic_write(path, write)


def listed_steps(manifest_text: str) -> list[int]:
    return [int(entry["step"]) for entry in json.loads(manifest_text)["checkpoints"]]


def manifest_text(root: Path) -> str | None:
    """The manifest of the checkpoint folder ``root`` (None: none yet)."""
    try:
        return (root / MANIFEST).read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None


def pack_steps(root: Path, steps: Iterable[int]) -> bytes:
    """The step folders of ``steps`` that ``root`` still holds, as tar bytes (not
    compressed: tensors barely compress, and gzip ran at ~38 MB/s)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for step in steps:
            folder = step_dir(root, step)
            if folder.is_dir():
                tar.add(folder, arcname=folder.name)
    return buffer.getvalue()


def mirror(root: Path, manifest: str, fetch: Callable[[list[int]], bytes]) -> bool:
    """Make ``root`` hold the checkpoints ``manifest`` (another folder's manifest text)
    lists, fetching the step folders it lacks with ``fetch(steps)`` (`pack_steps` of
    the other folder). False when the other folder no longer had one of them (it
    moved on since its manifest was read): nothing listed changes then."""
    entries = {int(e["step"]): e for e in json.loads(manifest)["checkpoints"]}
    steps = sorted(entries)
    missing = [s for s in steps if not step_dir(root, s).is_dir()]
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".incoming-*"):  # a copy a killed driver left half done
        shutil.rmtree(stale, ignore_errors=True)
    if missing:
        with tempfile.TemporaryDirectory(dir=root, prefix=".incoming-") as incoming:
            with tarfile.open(fileobj=io.BytesIO(fetch(missing)), mode="r:") as tar:
                tar.extractall(incoming, filter="data")
            arrived = {s for s in missing if _whole(step_dir(Path(incoming), s), entries[s])}
            for step in sorted(arrived):
                step_dir(Path(incoming), step).rename(step_dir(root, step))
        if arrived != set(missing):
            return False
    write_json(root / MANIFEST, json.loads(manifest))
    for folder in root.glob("step-*"):
        if folder.name not in {step_dir(root, s).name for s in steps}:
            shutil.rmtree(folder, ignore_errors=True)
    return True


def _whole(folder: Path, entry: dict[str, Any]) -> bool:
    """Whether ``folder`` holds every file its manifest entry lists, at its size (the
    machine may have been deleting it, an older one, while it was packed)."""
    files = entry.get("files", {})
    return folder.is_dir() and all(
        (folder / name).is_file() and (folder / name).stat().st_size == f.get("bytes", -1)
        for name, f in files.items()
    )
