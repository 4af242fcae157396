"""How the ranks of a run share (or do not share) their checkpoint folder.

Several machines may or may not mount one file system. Nothing is assumed:
at the start every rank leaves a probe file in the checkpoint folder and
reads which ranks' probes it sees. Ranks that see each other's files form a
*storage domain* (one per machine without a shared file system, one for the
whole run with one). Each domain holds a complete checkpoint on its own disk:

- a replicated shard (model, optimizer, ...) is written in every domain, by
  the domain's lowest rank that holds it;
- the lowest rank of each domain (its *leader*) writes that domain's manifest;
- the checksums of the files travel by collectives on a gloo group of their
  own (the persist thread's; the training thread keeps the default group), so
  no rank waits for another's files to appear.

With a shared file system this is exactly one writer per shard and one
manifest, as before.
"""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...runtime.distributed import World, all_gather_objects

PROBE = ".probe-rank{rank:05d}"


@dataclass(frozen=True)
class Domains:
    """``domain_of[r]``: the ranks whose files rank r sees (itself included)."""

    domain_of: tuple[frozenset[int], ...]
    shard_of: tuple[str, ...]

    def leader(self, rank: int) -> bool:
        return rank == min(self.domain_of[rank])

    def writes_shard(self, rank: int) -> bool:
        """The lowest rank of its domain holding its shard."""
        shard = self.shard_of[rank]
        return rank == min(r for r in self.domain_of[rank] if self.shard_of[r] == shard)

    @property
    def shared(self) -> bool:
        """One file system for every rank."""
        return len(self.domain_of[0]) == len(self.domain_of)


def probe_domains(root: Path, world: World, shard: str) -> Domains:
    """A collective: which ranks share ``root`` (it must exist on every rank)."""
    if world.world_size == 1:
        return Domains((frozenset({0}),), (shard,))
    token = all_gather_objects(uuid.uuid4().hex, world)[0]  # this run's, not a stale one
    mine = root / PROBE.format(rank=world.rank)
    # A folder this rank cannot write in (read-only): its first persist fails and says so.
    written = _write(mine, token)
    all_gather_objects(None, world)  # every probe is written
    seen = frozenset(
        rank for rank in range(world.world_size) if _read(root / PROBE.format(rank=rank)) == token
    ) | {world.rank}
    everyone = all_gather_objects((seen, shard), world)  # every probe is read
    if written:
        mine.unlink(missing_ok=True)
    return Domains(tuple(s for s, _ in everyone), tuple(n for _, n in everyone))


def _write(path: Path, text: str) -> bool:
    try:
        path.write_text(text)
    except OSError:
        return False
    return True


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


class Collectives:
    """The checkpoint's own process groups: one for the persist thread (checksums),
    one for the training thread (agreeing on when to checkpoint). Every rank makes
    them at the same moment (fit start); a single rank needs none."""

    def __init__(self, world: World) -> None:
        self.world = world
        multi = world.world_size > 1
        self._persist_group = dist.new_group(backend="gloo") if multi else None
        self._vote_group = dist.new_group(backend="gloo") if multi else None
        self._votes: deque[tuple[int, int, torch.Tensor, Any]] = deque()

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (from the persist thread)."""
        if self._persist_group is None:
            return [value]
        gathered: list[Any] = [None] * self.world.world_size
        dist.all_gather_object(gathered, value, group=self._persist_group)
        return gathered

    def cast_vote(self, for_step: int, cast_at: int, due: bool) -> None:
        """Start agreeing, without waiting, whether a checkpoint is due at ``for_step``:
        it is if any rank says so."""
        vote = torch.tensor([int(due)], dtype=torch.int32)
        work = None
        if self._vote_group is not None:
            work = dist.all_reduce(
                vote, op=dist.ReduceOp.MAX, group=self._vote_group, async_op=True
            )
        self._votes.append((for_step, cast_at, vote, work))

    def agreed(self, step: int) -> tuple[bool, int] | None:
        """The vote for ``step`` and the step it was cast at (None if none was cast)."""
        while self._votes and self._votes[0][0] < step:
            self._finish(self._votes.popleft())
        if not self._votes or self._votes[0][0] != step:
            return None
        _, cast_at, vote, _ = self._finish(self._votes.popleft())
        return bool(vote.item()), cast_at

    def close(self) -> None:
        while self._votes:
            self._finish(self._votes.popleft())

    @staticmethod
    def _finish(entry: tuple[int, int, torch.Tensor, Any]) -> tuple[int, int, torch.Tensor, Any]:
        if entry[3] is not None:
            entry[3].wait()  # cast steps ago: long done
        return entry
