"""Mirrors of several machines' checkpoint folders, each kept up to date by a
thread of its own (torch-free, Ray-free: the caller says how to fetch a chunk).

A checkpoint of gigabytes takes a while to arrive; meanwhile the run's progress,
its pruning and a lost machine must still be watched, and a slow or lost machine
must not hold up the others' copies. So `update` only notes each machine's newest
manifest, and each machine's thread copies its new step folders
(`checkpoint_folder.mirror`), at most `COPIES_AT_ONCE` machines at a time (each
holds a chunk in memory).
"""

from __future__ import annotations

import threading
from pathlib import Path

from .checkpoint_folder import Fetch, mirror

COPIES_AT_ONCE = 4


class MirrorsStopped(Exception):
    """Raised inside a fetch once `Mirrors.stop` was called: the copy is given up."""


class Mirrors:
    """``roots[k]``: where machine k's checkpoint folder is mirrored, fetched with
    ``fetchers[k]``. A fetch that raises one of ``gone`` means that machine is gone:
    it is followed no further (the run says so itself). Any other error (this
    machine's disk full) is raised again by the next `update` or by `finish`."""

    def __init__(
        self,
        fetchers: list[Fetch],
        roots: list[Path],
        gone: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.roots, self.gone = roots, gone
        self.fetchers = [self._stoppable(fetch) for fetch in fetchers]
        self.newest: list[str | None] = [None] * len(roots)  # each machine's manifest
        self.tried: list[str | None] = [None] * len(roots)  # the last one copied
        self.error: BaseException | None = None
        self._lost: set[int] = set()
        self._ending = self._stopped = False
        self._changed = threading.Condition()
        self._copying = threading.BoundedSemaphore(COPIES_AT_ONCE)
        self._threads = [
            threading.Thread(target=self._follow, args=(k,), name=f"mirror-{k}", daemon=True)
            for k in range(len(roots))
        ]
        for thread in self._threads:
            thread.start()

    def update(self, manifests: list[str | None]) -> None:
        """Each machine's newest manifest text (None: none yet); returns at once."""
        with self._changed:
            self._raise()
            for k, manifest in enumerate(manifests):
                if manifest is not None:
                    self.newest[k] = manifest
            self._changed.notify_all()

    def finish(self, lost: int | None = None) -> None:
        """Copy what the newest manifests list, then end (``lost``: a machine not to
        wait for)."""
        with self._changed:
            if lost is not None:
                self._lost.add(lost)
            self._ending = True
            self._changed.notify_all()
        for k, thread in enumerate(self._threads):
            if k != lost:  # its copy under way ends when Ray says the machine is gone
                thread.join()
        with self._changed:
            self._raise()

    def stop(self) -> None:
        """End without waiting: a copy under way is given up at its next chunk (its
        step folder never appears, the mirror's manifest stays as it was)."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()

    def _follow(self, k: int) -> None:
        """Machine k's thread."""
        while True:
            with self._changed:
                while not (self._stopped or self._ending or self._new(k)):
                    self._changed.wait()
                if self._stopped or not self._new(k):
                    return
                manifest = self.tried[k] = self.newest[k]
            assert manifest is not None
            try:
                with self._copying:
                    # False: the machine moved on meanwhile; its next manifest is copied.
                    mirror(self.roots[k], manifest, self.fetchers[k])
            except MirrorsStopped:
                return
            except self.gone:
                with self._changed:
                    self._lost.add(k)
                return
            except BaseException as error:  # noqa: BLE001 - raised on the caller's thread
                with self._changed:
                    self.error = error
                return

    def _new(self, k: int) -> bool:
        """Whether machine k has a manifest not copied yet."""
        return k not in self._lost and self.newest[k] not in (None, self.tried[k])

    def _raise(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _stoppable(self, fetch: Fetch) -> Fetch:
        def stoppable(step: int, name: str, offset: int, size: int) -> bytes | None:
            if self._stopped:
                raise MirrorsStopped
            return fetch(step, name, offset, size)

        return stoppable
