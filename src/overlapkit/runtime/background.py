"""overlapkit's background threads, stopped before the interpreter finalizes.

A daemon thread still inside a torch operation when Python finalizes is ended by
Python with ``pthread_exit`` as soon as the operation takes the GIL back; unwinding
that through torch's C++ frames aborts the whole process ("terminate called
without an active exception", SIGABRT) after the run itself is over. A stopped
run leaves such threads behind: a snapshot's copy, a persist, a prefetch feeder.
Every thread started here is asked to stop and joined by an `atexit` hook, which
runs while the interpreter is still whole.

torch's own threads meet the same end: a gloo worker frees each collective after it
completed, and that may take the GIL (a Python object in the work's saved thread
state; a core dump showed ``ProcessGroupGloo::runLoop -> ~AsyncAllreduceWork ->
~ThreadLocalState -> decref -> take_gil -> PyThread_exit_thread -> terminate``). A
worker the OS had not run yet when the last collective returned can so abort a
process that finished its work (18 of 40 runs of a 2-rank DDP script on a loaded
machine). A process that used a process group therefore releases the GIL for a
moment at exit, and those workers finish first (0 of 40 runs).
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

STOP_TIMEOUT_S = 10.0
SETTLE_S = 0.1  # at exit, for torch's communication threads (above)

_lock = threading.Lock()
_live: dict[threading.Thread, Callable[[], None] | None] = {}
_settle = threading.Event()


def settle_at_exit() -> None:
    """This process takes part in a process group: at exit, let gloo's worker
    threads finish freeing their collectives before the interpreter finalizes."""
    _settle.set()


def start_thread(
    target: Callable[..., Any],
    *args: Any,
    name: str,
    stop: Callable[[], None] | None = None,
) -> threading.Thread:
    """Start ``target(*args)`` on a daemon thread that is stopped (``stop``, if
    given, asks it to end soon) and joined before the interpreter exits."""

    def run() -> None:
        try:
            target(*args)
        finally:
            with _lock:
                _live.pop(threading.current_thread(), None)

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _lock:
        _live[thread] = stop
    thread.start()
    return thread


def stop_all(timeout_s: float = STOP_TIMEOUT_S) -> list[str]:
    """Ask every live background thread to stop and wait up to ``timeout_s`` in all;
    return the names of those still running."""
    with _lock:
        live = [(t, stop) for t, stop in _live.items() if t.is_alive()]
    for _, stop in live:
        if stop is not None:
            stop()
    deadline = time.monotonic() + timeout_s
    for thread, _ in live:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [thread.name for thread, _ in live if thread.is_alive()]


def _at_exit() -> None:
    left = stop_all()
    if left:
        print(
            f"overlapkit: background work did not stop within {STOP_TIMEOUT_S:.0f} s at exit "
            f"({', '.join(left)}); the process may abort as it ends",
            file=sys.stderr,
        )
    if _settle.is_set():
        time.sleep(SETTLE_S)  # releases the GIL


atexit.register(_at_exit)
