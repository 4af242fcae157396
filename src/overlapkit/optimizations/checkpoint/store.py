"""Phase two of a checkpoint, on disk: durable files, a manifest, integrity checks.

Layout under the checkpoint folder::

    manifest.json                the checkpoints that are complete, with checksums
    step-00000120/
        shared.ckpt              replicated state (model, optimizer, ...), written by rank 0
                                 (pipeline stages: stage000.ckpt, ... one per stage)
        rank00000.ckpt, ...      each rank's own state (RNG, loader position, ...)

A file is written to a temporary name, fsynced, renamed and its folder
fsynced; the manifest is replaced the same way, and only after it names a
new checkpoint are older ones deleted. Without a shared file system each
machine holds this layout for its own ranks, shared shards included (see
`coordination`). A step folder the manifest does not
name (a crash mid-persist) is ignored and cleaned up later.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...runtime.checkpoint_folder import MANIFEST, step_dir, write_json
from ...runtime.persist import atomic_write
from . import fileformat


class CheckpointError(RuntimeError):
    """Persisting or resuming a checkpoint failed (and ``on_error`` is ``stop``)."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.ckpt"


def shard_file(name: str) -> str:
    """The file of a replicated shard (see `overlapkit.runtime.state.Shard`)."""
    return f"{name}.ckpt"


def checkpoint_folder(run_dir: Path, configured: str | Path) -> Path:
    """The checkpoint folder of a run in ``run_dir``: ``configured`` (checkpoint.dir)
    under it, unless absolute."""
    path = Path(configured).expanduser()
    return path if path.is_absolute() else run_dir / path


def fresh_flags(run_dir: Path, configured: str | Path) -> str:
    """The ``overlapkit run`` flags that start a run of ``run_dir`` over with its
    checkpoint folder (``configured``: checkpoint.dir) kept aside: the run folder is
    named unless the checkpoint folder is absolute and outside it (it may be shared by
    several run folders; a relative one is found from the run folder)."""
    absolute = Path(configured).expanduser().is_absolute()
    if absolute and not holds(run_dir, checkpoint_folder(run_dir, configured)):
        return "--fresh"
    return f"--out {run_dir} --fresh"


def holds(run_dir: Path, root: Path) -> bool:
    """Whether the checkpoint folder ``root`` lies inside the run folder ``run_dir``."""
    return root.resolve().is_relative_to(run_dir.resolve())


def write_state(path: Path, tree: Any, gate: Callable[[], None] | None = None) -> dict[str, Any]:
    """Durably write ``tree`` (see `fileformat`); return its checksum and size.
    ``gate`` is called between chunks (background work yields there)."""
    return atomic_write(path, lambda fd: fileformat.write(fd, tree, gate), direct=True)


@dataclass
class Manifest:
    root: Path

    @property
    def path(self) -> Path:
        return self.root / MANIFEST

    def read(self) -> list[dict[str, Any]]:
        """The complete checkpoints, oldest first ([] when there is no manifest). A
        damaged one (it is replaced atomically, so something else cut or edited it) is
        a `CheckpointError`: read as empty, a resume would start over and the next
        checkpoint's clean-up would delete the step folders it no longer listed."""
        return self._document().get("checkpoints", [])

    def setup(self) -> dict[str, Any] | None:
        """The setup the checkpoints are of (see `State.setup`; None: not recorded)."""
        document = self._document()
        setup = document.get("setup") if document.get("checkpoints") else None
        return setup if isinstance(setup, dict) else None

    def _document(self) -> dict[str, Any]:
        """The manifest as written, its checkpoints checked ({} when there is none)."""
        try:
            raw = self.path.read_bytes()  # decoded below: bytes not UTF-8 are damage too
        except (FileNotFoundError, NotADirectoryError):
            return {}
        try:
            document = json.loads(raw.decode())
            entries = document["checkpoints"]
            if not isinstance(entries, list) or not all(map(_well_formed, entries)):
                raise TypeError("no list of checkpoints, each with a step number and files")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
            raise CheckpointError(
                f"{self.path} is damaged ({type(error).__name__}: {error}): the checkpoints "
                "beside it cannot be verified, so none is resumed and none is deleted. "
                "Restore the file, or start over (overlapkit run --fresh keeps them aside)"
            ) from None
        return document

    def add(
        self, entry: dict[str, Any], keep: int, setup: dict[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        """Durably add ``entry`` (and ``setup``, what the checkpoints are of); then delete
        all but the newest ``keep`` checkpoints."""
        entries = [e for e in self.read() if e["step"] != entry["step"]] + [entry]
        entries.sort(key=lambda e: e["step"])
        kept = entries[-keep:]
        document = {"format": 1, "checkpoints": kept}
        if setup is not None:
            document["setup"] = setup
        write_json(self.path, document)
        # Only now that the manifest naming the new checkpoint is durable: clean up
        # older folders (dropped ones, crash leftovers). Newer ones may still be
        # being written by other ranks.
        wanted = {e["step"] for e in kept}
        for folder in self.root.glob("step-*"):
            step = _step_of(folder)
            if step is not None and step not in wanted and step < kept[-1]["step"]:
                shutil.rmtree(folder, ignore_errors=True)
        return kept


def _well_formed(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and type(entry.get("step")) is int
        and isinstance(entry.get("files"), dict)
    )


def _step_of(folder: Path) -> int | None:
    try:
        return int(folder.name.removeprefix("step-"))
    except ValueError:
        return None


def verify(root: Path, entry: dict[str, Any], files: list[str]) -> str | None:
    """None if ``files`` of the checkpoint match their checksums, else what is wrong."""
    folder = step_dir(root, entry["step"])
    for name in files:
        expected = entry["files"].get(name)
        if expected is None:
            return f"{name} is not in the manifest"
        path = folder / name
        if not path.exists():
            return f"{path} is missing"
        crc = fileformat.Crc32c()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                crc.update(chunk)
        if crc.hexdigest() != expected.get(crc.name) or path.stat().st_size != expected["bytes"]:
            return f"{path} does not match its checksum (truncated or corrupted)"
    return None


def load_state(root: Path, step: int, name: str) -> Any:
    return fileformat.read(step_dir(root, step) / name)
