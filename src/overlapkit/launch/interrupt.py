"""SIGINT and SIGTERM stop a run cleanly: every rank leaves its loop, says where it
was, and the command line says how to resume.

A rank turns the first signal into `RunInterrupted` on its main thread; a second
one (Ctrl-C reaches every process of the terminal's group, and the launcher
forwards the signal too) is ignored while it stops. A checkpoint being persisted
at that moment is discarded safely: it is not in the manifest until every rank
wrote it, so the run resumes from the newest complete one.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunInterrupted(KeyboardInterrupt):
    """The run was stopped by ``signum``, at ``step`` (None if unknown), with the
    newest complete checkpoint at ``checkpoint_step`` (None: none); ``finished``: after
    its last step, its results written (as its summary was printed, say)."""

    def __init__(
        self,
        signum: int,
        step: int | None = None,
        checkpoint_step: int | None = None,
        finished: bool = False,
    ) -> None:
        self.signum, self.step, self.checkpoint_step = signum, step, checkpoint_step
        self.finished = finished
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # 130 for SIGINT, 143 for SIGTERM, as shells report them

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    def record(self) -> dict[str, Any]:
        return {
            "interrupted": self.signum,
            "step": self.step,
            "checkpoint": self.checkpoint_step,
            "finished": self.finished,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> RunInterrupted:
        return cls(
            record["interrupted"],
            record.get("step"),
            record.get("checkpoint"),
            bool(record.get("finished")),
        )


# Set while the main thread, stopped by Ctrl-C, waits for the threads doing its work
# (tune's trials, here or on a Ray cluster): a signal reaches the main thread only.
_STOPPING = threading.Event()


@contextmanager
def threads_stopping() -> Iterator[None]:
    """Within: `stop_if_asked` raises KeyboardInterrupt in every thread that calls it."""
    _STOPPING.set()
    try:
        yield
    finally:
        _STOPPING.clear()


def stop_asked() -> bool:
    """Whether the main thread was stopped (`threads_stopping`)."""
    return _STOPPING.is_set()


def stop_if_asked() -> None:
    """Raise KeyboardInterrupt here if the main thread was stopped (`threads_stopping`):
    for loops that wait on work of their own in a thread (a trial's processes)."""
    if _STOPPING.is_set():
        raise KeyboardInterrupt


def exit_now(code: int) -> None:
    """End an interrupted rank at once. Its work is on disk (checkpoints are complete
    or absent); a normal exit would tear down process groups whose threads may still
    wait on a peer that left, and gloo then aborts the process at exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass
class Received:
    signals: list[int] = field(default_factory=list)

    @property
    def first(self) -> int | None:
        return self.signals[0] if self.signals else None


# What gloo and NCCL say when a peer's process is gone (its connection closed).
PEER_GONE = ("closed by peer", "reset by peer", "broken pipe", "remote process exited")


def peer_left(error: BaseException) -> bool:
    """A collective failed because a peer left (not this rank's own error)."""
    if not isinstance(error, RuntimeError):  # torch.distributed's errors are RuntimeErrors
        return False
    text = str(error).lower()
    return any(words in text for words in PEER_GONE)


def await_signal(received: Received, seconds: float) -> None:
    """Wait up to ``seconds`` for a stop signal. A rank whose peer was interrupted sees
    its collective fail ("connection closed by peer") a moment before its launcher,
    which saw the peer leave, signals it too: that error is the signal's."""
    deadline = time.monotonic() + seconds
    try:
        while received.first is None and time.monotonic() < deadline:
            time.sleep(0.02)
    except RunInterrupted:
        pass  # recorded in ``received``


# Execs the interpreter of its first argument with SIGINT blocked: an isolated `-S`
# Python starts in milliseconds, and a signal mask (with what it holds pending) survives exec.
_BLOCK_SIGINT = (
    "import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


@contextmanager
def ranks_hold_ctrl_c_until_ready(folder: Path) -> Iterator[None]:
    """Within: the ranks multiprocessing spawns start with SIGINT blocked, held until
    `release_held_ctrl_c`. A new rank spends its first seconds importing torch (and
    TensorFlow) before any code of ours runs, and a Ctrl-C there printed a
    KeyboardInterrupt traceback per rank; now the rank stops as soon as it can say so.

    The interpreter the ranks run is a shell script in ``folder`` that execs an
    isolated ``-S`` Python to block SIGINT, which execs this interpreter. Off Linux, or
    where the script does not run (a ``noexec`` mount, a policy that refuses it),
    nothing changes."""
    import multiprocessing.spawn as spawn

    interpreter = spawn.get_executable()
    wrapper = folder / "python"
    if not sys.platform.startswith("linux") or not _wrap_interpreter(interpreter, wrapper):
        yield
        return
    spawn.set_executable(str(wrapper))
    try:
        yield
    finally:
        spawn.set_executable(interpreter)


def _wrap_interpreter(interpreter: str | bytes, wrapper: Path) -> bool:
    """Write ``wrapper``, the interpreter with SIGINT blocked; whether it runs."""
    import subprocess

    python = shlex.quote(os.fsdecode(interpreter))
    script = f'#!/bin/sh\nexec {python} -I -S -c {shlex.quote(_BLOCK_SIGINT)} {python} "$@"\n'
    try:
        wrapper.write_bytes(os.fsencode(script))
        wrapper.chmod(0o700)
        tried = subprocess.run([wrapper, "-I", "-S", "-c", ""], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return tried.returncode == 0


def release_held_ctrl_c() -> None:
    """Unblock SIGINT in this thread: a rank of overlapkit's launcher starts with it
    blocked (`ranks_hold_ctrl_c_until_ready`), and a Ctrl-C held since then arrives now,
    as the KeyboardInterrupt of the handler in place."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@contextmanager
def stop_on_signals() -> Iterator[Received]:
    """Within: SIGINT/SIGTERM raise `RunInterrupted` once; later ones are ignored.
    Yields what was received, so that an error the interruption caused (a peer that
    left mid-collective) can be told from a real failure."""
    received = Received()

    def handler(signum: int, _frame: Any) -> None:
        received.signals.append(signum)
        if len(received.signals) == 1:
            raise RunInterrupted(signum)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield received
    finally:
        for s, old in previous.items():
            # Once stopping, stay deaf: the launcher's copy of the signal must not break
            # the interpreter's exit (a KeyboardInterrupt inside atexit aborts it).
            signal.signal(s, signal.SIG_IGN if received.signals else old)
