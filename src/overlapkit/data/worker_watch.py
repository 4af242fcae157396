"""DataLoader workers that end with the process that started them.

torch's worker notices a parent that died (a rank SIGKILLed, or taken by the OOM
killer) and leaves its loop, but its exit then waits for the thread that writes its
batches into the shared result pipe. Batches that travel by value (numpy arrays, lists)
fill that pipe, and every worker holds the pipe's read end too (inherited at fork), so
the write never fails and the worker never exits: it stays, with its memory, for good.
An overlapkit loader's workers end at once when their parent is gone.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

CHECK_EVERY_S = 1.0


class EndsWithParent:
    """A worker init function: a thread that ends the worker (``os._exit``) once its
    parent is gone, then ``init`` (the loader's own), if any. Made in the process that
    builds the loader: a worker whose parent is no longer that process, which no longer
    lives, lost it before it started (it was adopted) and ends at once. A live one is
    not the parent under a forkserver or spawn context: the worker watches its own."""

    def __init__(self, init: Callable[[int], None] | None) -> None:
        self.init = init
        self.maker = os.getpid()

    def __call__(self, worker_id: int) -> None:
        parent = os.getppid()
        if parent != self.maker and not _alive(self.maker):
            os._exit(0)

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(CHECK_EVERY_S)
            os._exit(0)

        threading.Thread(target=watch, name="overlapkit-parent-watch", daemon=True).start()
        if self.init is not None:
            self.init(worker_id)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process now holds the number
        return False
    return True


def ends_with_parent(init: Callable[[int], None] | None) -> EndsWithParent:
    """``init`` (a worker init function, or None) in a worker that ends with its parent;
    one already wrapped stays as it is."""
    return init if isinstance(init, EndsWithParent) else EndsWithParent(init)
