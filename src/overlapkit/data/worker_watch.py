"""DataLoader workers that end with the process that started them.

torch's worker notices a parent that died (a rank SIGKILLed, or taken by the OOM
killer) and leaves its loop, but its exit then waits for the thread that writes its
batches into the shared result pipe. Batches that travel by value (numpy arrays, lists)
fill that pipe, and every worker holds the pipe's read end too (inherited at fork), so
the write never fails and the worker never exits: it stays, with its memory, for good.
An overlapkit loader's workers end at once when the process that built it is gone.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any

CHECK_EVERY_S = 1.0


class EndsWithParent:
    """A worker init function: a thread that ends the worker (``os._exit``) once its
    parent or the process that starts its loader's workers is gone, then ``init`` (the
    loader's own), if any. Under the fork and spawn contexts they are one; under
    forkserver (Python 3.14's default) the parent is a server that outlives a killed
    rank, so that process is watched too (through a pidfd, where there are pidfds). A
    worker whose loader's process died before its init ran ends at once."""

    def __init__(self, init: Callable[[int], None] | None) -> None:
        self.init = init
        self.maker = os.getpid()  # forked workers: the process that built the loader

    def __getstate__(self) -> dict[str, Any]:
        # Pickled for spawn or forkserver workers by the process starting them (a rank
        # iterating a loader built before it started).
        return {**self.__dict__, "maker": os.getpid()}

    def __call__(self, worker_id: int) -> None:
        try:
            maker: int | None = os.pidfd_open(self.maker)
        except ProcessLookupError:  # already gone
            os._exit(0)
        except (AttributeError, OSError):  # no pidfds here
            maker = None
        threading.Thread(
            target=_end_with, args=(maker, os.getppid()), name="overlapkit-maker-watch", daemon=True
        ).start()
        if self.init is not None:
            self.init(worker_id)


def _end_with(maker: int | None, parent: int) -> None:
    """Ends this process once ``maker`` (a pidfd) or its parent has ended."""
    ended = None
    if maker is not None:  # poll, not select: a pidfd may be numbered past 1024
        ended = select.poll()
        ended.register(maker, select.POLLIN)
    while os.getppid() == parent:
        if ended is None:
            time.sleep(CHECK_EVERY_S)
        elif ended.poll(CHECK_EVERY_S * 1000):  # readable: it ended
            break
    os._exit(0)


def ends_with_parent(init: Callable[[int], None] | None) -> EndsWithParent:
    """``init`` (a worker init function, or None) in a worker that ends with its parent;
    one already wrapped stays as it is."""
    return init if isinstance(init, EndsWithParent) else EndsWithParent(init)
