"""A checkpoint folder's layout (its manifest, its step folders), and a copy of
another machine's checkpoint folder, kept up to date while it grows. Torch-free:
the Ray actor on each machine reads its folder with it.

A run on a cluster writes each machine's checkpoints to that machine's disk; the
driver keeps a mirror of each, so that a run whose machine, driver or ranks are
lost resumes from the newest checkpoint that reached it. The manifest says which
step folders are complete: the mirror fetches the ones it lacks, moves each into
place whole, then replaces its manifest (atomically), then removes the step
folders the manifest no longer lists. Killed at any moment, its manifest names
only complete step folders. Files travel in chunks of `CHUNK_BYTES`, so a copy of a
checkpoint of many gigabytes holds one chunk in memory at a time, never the whole.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import crc32c

from .persist import atomic_write

MANIFEST = "manifest.json"  # the complete checkpoints of a checkpoint folder
# The most bytes of a file that one transfer carries (what a copy holds in memory).
CHUNK_BYTES = 64 << 20

# fetch(step, file name, offset, size): up to ``size`` bytes of that file from
# ``offset`` in the other folder (`read_chunk` there); None when it is gone.
Fetch = Callable[[int, str, int, int], "bytes | None"]


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
    return list(_by_step(json.loads(manifest_text)))


def manifest_text(root: Path) -> str | None:
    """The manifest of the checkpoint folder ``root`` (None: none yet)."""
    try:
        return (root / MANIFEST).read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None


def listed_files(manifest: str) -> Iterator[tuple[int, str, int]]:
    """(step, file name, size) of every file of every checkpoint ``manifest`` lists."""
    for entry in json.loads(manifest)["checkpoints"]:
        for name, record in entry.get("files", {}).items():
            yield int(entry["step"]), name, int(record["bytes"])


def read_chunk(root: Path, step: int, name: str, offset: int, size: int) -> bytes | None:
    """Up to ``size`` bytes of the file ``name`` of ``step``'s folder under ``root``,
    from ``offset`` (None: the machine has removed it since)."""
    try:
        with open(step_dir(root, step) / _plain(name), "rb") as f:
            f.seek(offset)
            return f.read(size)
    except (FileNotFoundError, NotADirectoryError):
        return None


def write_chunk(root: Path, step: int, name: str, offset: int, data: bytes) -> None:
    """``data`` into the file ``name`` of ``step``'s folder under ``root``, at ``offset``
    (the folder and file made as needed; not durable until `finish_files`)."""
    folder = step_dir(root, step)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / _plain(name), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written
    finally:
        os.close(fd)


def finish_files(root: Path, manifest: str) -> None:
    """Make the files ``manifest`` lists under ``root`` durable, then the manifest."""
    for step, name, _ in listed_files(manifest):
        fd = os.open(step_dir(root, step) / name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    write_json(root / MANIFEST, json.loads(manifest))


def mirror(root: Path, manifest: str, fetch: Fetch) -> bool:
    """Make ``root`` hold the checkpoints ``manifest`` (another folder's manifest text)
    lists, fetching the step folders it lacks file by file, chunk by chunk, with
    ``fetch`` (see `Fetch`). A step folder is taken only whole: each file at its
    size and checksum. False when the other folder no longer had one of them (it
    moved on since its manifest was read): nothing listed changes then."""
    document = json.loads(manifest)
    entries = _by_step(document)
    steps = sorted(entries)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".incoming-*"):  # a copy a killed driver left half done
        shutil.rmtree(stale, ignore_errors=True)
    # A step folder held for another entry than this one (the machine wrote that step
    # again after a resume from an older one; or a killed copy's, never listed here):
    # unlisted first, then removed, then fetched again.
    held_text = manifest_text(root)
    held_document = json.loads(held_text) if held_text else {"checkpoints": []}
    held = _by_step(held_document)
    stale = [s for s in steps if step_dir(root, s).is_dir() and held.get(s) != entries[s]]
    if stale:
        kept = [e for step, e in sorted(held.items()) if step not in stale]
        write_json(root / MANIFEST, {**held_document, "checkpoints": kept})
        for step in stale:
            shutil.rmtree(step_dir(root, step))
    missing = [s for s in steps if not step_dir(root, s).is_dir()]
    for step in missing:
        with tempfile.TemporaryDirectory(dir=root, prefix=".incoming-") as incoming:
            folder = Path(incoming) / step_dir(root, step).name
            if not _copy(folder, step, entries[step], fetch):
                return False
            folder.rename(step_dir(root, step))
    write_json(root / MANIFEST, document)
    listed = {step_dir(root, s).name for s in steps}
    for folder in root.glob("step-*"):
        if folder.name not in listed:
            shutil.rmtree(folder, ignore_errors=True)
    return True


def _by_step(document: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """A manifest's checkpoint entries by step."""
    return {int(entry["step"]): entry for entry in document["checkpoints"]}


def _copy(folder: Path, step: int, entry: dict[str, Any], fetch: Fetch) -> bool:
    """The files of ``entry`` into ``folder``, durable; False when one came short or
    does not match its checksum (the machine was deleting it, an older one)."""
    folder.mkdir()
    for name, record in entry.get("files", {}).items():
        size, checksum = int(record["bytes"]), 0
        with open(folder / _plain(name), "wb") as out:
            while out.tell() < size:
                chunk = fetch(step, name, out.tell(), min(CHUNK_BYTES, size - out.tell()))
                if not chunk:
                    return False
                out.write(chunk)
                checksum = crc32c.crc32c(chunk, checksum)
            out.flush()
            os.fsync(out.fileno())
        if "crc32c" in record and f"{checksum:08x}" != record["crc32c"]:
            return False
    return True


def _plain(name: str) -> str:
    """A file name of a step folder, never a path out of it."""
    if not name or Path(name).name != name or name in (".", ".."):
        raise ValueError(f"not a checkpoint file name: {name!r}")
    return name
