"""Writes finished snapshots to disk in a background thread, one after another."""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path
from time import perf_counter
from typing import Any

from ...runtime import Resource
from ...runtime.arbitration import ArbitrationPolicy
from ...runtime.background import start_thread
from ...runtime.state import Shard
from .coordination import Collectives, Domains
from .snapshot import Snapshot
from .store import CheckpointError, Manifest, rank_file, shard_file, step_dir, write_state

# Replicated across the ranks of a shard: written once, by its writer.
SHARED_KEYS = ("model", "model_paths", "optimizer", "lr_scheduler", "precision", "progress")


def split_state(tree: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    shared = {k: v for k, v in tree.items() if k in SHARED_KEYS}
    own = {k: v for k, v in tree.items() if k not in SHARED_KEYS}
    return shared, own


class PersistAbandoned(Exception):
    """The process is ending before this persist finished (its step stays unlisted)."""


class Persister:
    """A thread that persists snapshots in order; `error` holds the first failure."""

    def __init__(
        self,
        root: Path,
        rank: int,
        world_size: int,
        keep: int,
        policy: ArbitrationPolicy,
        shard: Shard,
        domains: Domains,
        collectives: Collectives,
        nice: int = 10,
        setup: dict[str, Any] | None = None,
    ) -> None:
        self.root, self.rank, self.world_size, self.keep = root, rank, world_size, keep
        self.shard = shard
        self.domains, self.collectives = domains, collectives
        self.nice = nice
        self.setup = setup  # recorded in the manifest (see `State.setup`)
        self.manifest = Manifest(root)
        self.policy = policy
        self.error: BaseException | None = None
        self.persist_s: list[float] = []
        self.copy_s: list[float] = []  # each snapshot's background copy
        self.bytes_written = 0
        self.in_flight = 0
        self._queue: queue.Queue[Snapshot | None] = queue.Queue()
        self._idle = threading.Condition()
        self._abandoned = threading.Event()
        self._thread = start_thread(self._run, name="overlapkit-persist", stop=self.abandon)

    def submit(self, snapshot: Snapshot) -> None:
        with self._idle:
            self.in_flight += 1
        self._queue.put(snapshot)

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait until every submitted snapshot is persisted (or failed)."""
        with self._idle:
            self._idle.wait_for(lambda: self.in_flight == 0, timeout=timeout_s)

    def close(self) -> None:
        self.drain()
        self._queue.put(None)
        self._thread.join(timeout=10)

    def abandon(self) -> None:
        """End the thread soon, leaving what is not persisted yet (a stopped run's
        exit): a write under way stops at its next chunk; no collective is joined."""
        self._abandoned.set()
        self._queue.put(None)

    def _run(self) -> None:
        self.policy.join("persist")  # a policy that places work on cores places this thread
        # Linux applies nice values per thread: the persist fills the cores' idle gaps
        # instead of taking them from the training step's compute threads.
        if self.nice:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except (AttributeError, OSError):
                pass
        while (snapshot := self._queue.get()) is not None:
            try:
                if self.error is None and not self._abandoned.is_set():
                    self._persist(snapshot)
            except BaseException as error:  # reported on the training thread
                self.error = error
            finally:
                snapshot.buffers.free.set()
                with self._idle:
                    self.in_flight -= 1
                    self._idle.notify_all()

    def _persist(self, snapshot: Snapshot) -> None:
        start = perf_counter()
        try:
            files: dict[str, Any] | str = self._write(snapshot)
        except PersistAbandoned:
            raise  # the process is ending: its peers may be gone
        except Exception as error:  # every rank must still hear of it (below)
            files, failure = f"{type(error).__name__}: {error}", error
        else:
            failure = None
        # Every rank takes part whatever happened: a rank that left would hang the rest.
        everyone = self.collectives.gather((self.rank, snapshot.step, files))
        if failure is not None:
            raise failure
        failed = [(rank, what) for rank, _, what in everyone if isinstance(what, str)]
        if failed:
            rank, what = failed[0]
            raise CheckpointError(f"rank {rank} could not write step {snapshot.step}: {what}")
        steps = sorted({step for _, step, _ in everyone})
        if steps != [snapshot.step]:
            raise CheckpointError(f"the ranks checkpointed different steps at once: {steps}")
        if self.domains.leader(self.rank):
            domain = self.domains.domain_of[self.rank]
            entry = {
                "step": snapshot.step,
                "time": time.time(),
                "world_size": self.world_size,
                "files": {
                    n: r for rank, _, fs in everyone if rank in domain for n, r in fs.items()
                },
            }
            self.manifest.add(entry, self.keep, self.setup)
        # Every rank's files of this checkpoint (each file is written by one rank).
        self.bytes_written += sum(r["bytes"] for _, _, fs in everyone for r in fs.values())
        self.persist_s.append(perf_counter() - start)

    def _write(self, snapshot: Snapshot) -> dict[str, Any]:
        """This rank's files of ``snapshot``, durable: {name: checksum and size}."""
        snapshot.wait()
        self.copy_s.append(snapshot.copy_s)
        folder = step_dir(self.root, snapshot.step)
        shared, own = split_state(snapshot.tree)
        files = {}

        def gate() -> None:
            if self._abandoned.is_set():
                raise PersistAbandoned(f"step {snapshot.step}")
            # Under the "priority" policy the writes pause between 4 MiB chunks while the
            # step waits on what they use (the host CPU for checksums and copies, the disk).
            self.policy.pause(Resource.DISK, Resource.HOST_CPU)

        files[rank_file(self.rank)] = write_state(folder / rank_file(self.rank), own, gate)
        if shared:  # only the shard's writer (in its storage domain) keeps it in its snapshot
            name = shard_file(self.shard.name)
            files[name] = write_state(folder / name, shared, gate)
        return files
