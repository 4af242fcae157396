"""overlapkit's background threads, stopped before the interpreter finalizes.

A daemon thread still inside a torch operation when Python finalizes is ended by
Python with ``pthread_exit`` as soon as the operation takes the GIL back; unwinding
that through torch's C++ frames aborts the whole process ("terminate called
without an active exception", SIGABRT) after the run itself is over. A stopped
run leaves such threads behind: a snapshot's copy, a persist, a prefetch feeder.
Every thread started here is asked to stop and joined by an `atexit` hook, which
runs while the interpreter is still whole.
"""

from __future__ import annotations

import atexit
import sys
import threading
from collections.abc import Callable
from time import monotonic
from typing import Any

STOP_TIMEOUT_S = 10.0

_lock = threading.Lock()
_live: dict[threading.Thread, Callable[[], None] | None] = {}


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
    deadline = monotonic() + timeout_s
    for thread, _ in live:
        thread.join(max(0.0, deadline - monotonic()))
    return [thread.name for thread, _ in live if thread.is_alive()]


def _at_exit() -> None:
    left = stop_all()
    if left:
        print(
            f"overlapkit: background work did not stop within {STOP_TIMEOUT_S:.0f} s at exit "
            f"({', '.join(left)}); the process may abort as it ends",
            file=sys.stderr,
        )


atexit.register(_at_exit)
