"""Finding and loading the newest checkpoint that every rank can read intact."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from ...runtime.distributed import World, all_gather_objects
from ...runtime.state import Shard
from .store import Manifest, load_state, rank_file, shard_file, verify


class CheckpointCorruptWarning(UserWarning):
    """The newest checkpoint failed its checksum; an older one is used."""


def valid_steps(root: Path, rank: int, world_size: int, shard: Shard) -> list[int]:
    """Steps whose files this rank needs are present and match their checksums, newest first."""
    steps = []
    for entry in reversed(Manifest(root).read()):
        if entry.get("world_size", world_size) != world_size:
            raise ValueError(
                f"the checkpoint at step {entry['step']} in {root} was written by "
                f"{entry['world_size']} ranks; this run has {world_size}"
            )
        problem = verify(root, entry, [rank_file(rank), shard_file(shard.name)])
        if problem is None:
            steps.append(entry["step"])
        else:
            warnings.warn(
                f"skipping the checkpoint at step {entry['step']}: {problem}",
                CheckpointCorruptWarning,
                stacklevel=2,
            )
    return steps


def newest_common_step(root: Path, world: World, shard: Shard) -> int | None:
    """The newest step that every rank holds intact (ranks must agree on one)."""
    mine = valid_steps(root, world.rank, world.world_size, shard)
    everyone = all_gather_objects(mine, world)
    common = set(everyone[0]).intersection(*everyone[1:]) if everyone else set()
    return max(common) if common else None


def load(root: Path, step: int, rank: int, shard: Shard) -> dict[str, Any]:
    state = load_state(root, step, rank_file(rank))
    state.update(load_state(root, step, shard_file(shard.name)))
    return state
