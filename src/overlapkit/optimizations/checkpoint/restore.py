"""Finding and loading the newest checkpoint that every rank can read intact."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from ...runtime.distributed import World, all_gather_objects
from ...runtime.state import Shard
from .store import CheckpointError, Manifest, load_state, rank_file, shard_file, verify


class CheckpointCorruptWarning(UserWarning):
    """The newest checkpoint failed its checksum; an older one is used."""


START_OVER = (
    "start over with overlapkit run --fresh (the old checkpoints are kept aside; in a "
    "script of your own, another checkpoint folder or checkpoint resume: false)"
)


def check_rank_count(
    root: Path, world_size: int, start_over: str = START_OVER, error: type = CheckpointError
) -> list[dict]:
    """The manifest's entries in ``root``, newest first; raise ``error`` when it holds
    checkpoints of another rank count (``start_over`` says how else to go on)."""
    entries = list(reversed(Manifest(root).read()))
    for entry in entries:
        written = entry.get("world_size", world_size)
        if written != world_size:
            raise error(
                f"the checkpoint at step {entry['step']} in {root} was written by {written} "
                f"rank{'s' if written != 1 else ''}; this run has {world_size}: resume it "
                f"with {written}, or {start_over}"
            )
    return entries


def valid_steps(root: Path, rank: int, world_size: int, shard: Shard) -> list[int]:
    """Steps whose files this rank needs are present and match their checksums, newest first."""
    steps = []
    for entry in check_rank_count(root, world_size):
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
    """The newest step that every rank holds intact, agreed by a collective; None when
    no rank holds any. A rank that holds none while others do is an error: starting it
    fresh beside resumed ranks would train two different models. So is a manifest
    that lists checkpoints none of which is intact: a fresh start would write its own
    over them (and its clean-up delete the rest), as if there had been none."""
    mine = valid_steps(root, world.rank, world.world_size, shard)
    listed = [entry["step"] for entry in Manifest(root).read()]
    gathered = all_gather_objects((mine, listed), world)
    everyone = [steps for steps, _ in gathered]
    if not any(everyone):
        damaged = sorted({step for _, steps in gathered for step in steps})
        if damaged:
            raise CheckpointError(
                f"cannot resume: none of the checkpoints in {root} is intact (step(s) "
                f"{', '.join(map(str, damaged))}: see the warnings above), so none is "
                "resumed and none is written over. Restore their files, or start over with "
                "overlapkit run --fresh (they are kept aside; in a script of your own, "
                "another checkpoint folder or checkpoint resume: false)"
            )
        return None
    common = set(everyone[0]).intersection(*everyone[1:])
    if common:
        return max(common)
    empty = [rank for rank, steps in enumerate(everyone) if not steps]
    held = "; ".join(
        f"rank {rank}: steps {', '.join(map(str, sorted(steps)))}"
        for rank, steps in enumerate(everyone)
        if steps
    )
    if empty:
        problem = (
            f"rank(s) {', '.join(map(str, empty))} hold no intact checkpoint in {root} "
            f"on their machine while others do ({held})"
        )
    else:
        problem = f"the ranks hold no checkpoint step in common in {root} ({held})"
    raise CheckpointError(
        f"cannot resume: {problem}. Each machine needs its ranks' files (a shared file "
        "system, or a copy of the folder); or start fresh with checkpoint resume: false"
    )


def load(root: Path, step: int, rank: int, shard: Shard) -> dict[str, Any]:
    state = load_state(root, step, rank_file(rank))
    state.update(load_state(root, step, shard_file(shard.name)))
    return state
