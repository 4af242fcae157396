"""Start a trial's ``overlapkit run`` process: forked from a server that imported
torch and overlapkit once (CPU), or a fresh interpreter (GPUs).

A fresh interpreter spends ~4 s on 2 cores before the trial's first step:
Python, torch, and torch._dynamo (which the first optimizer's ``__init__``
imports). Trials of a few steps are mostly that. A forkserver child is an
ordinary process of its own (own session and process group, killed with it,
its own files) that starts in ~0.1 s. GPU trials keep the fresh interpreter:
the CUDA devices a trial may see must be set before torch first looks.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from ..launch.local import die_with, resource_tracker_quiet

PRELOAD = [
    "overlapkit.tuning.quiet_server",  # first: Ctrl-C while the server imports, ignored
    "torch",
    "torch._dynamo",
    "overlapkit.cli",
    "overlapkit.run",
]
# tune's workers are threads. A start reaps the server's ended children, as a poll
# does: one status read by two threads at once lost it for one (exit status 255).
_FORKED = threading.Lock()
_server_started = False


class TrialProcess(Protocol):
    pid: int

    def poll(self) -> int | None: ...

    def wait(self) -> int: ...


def start_trial_process(
    command: list[str],
    stdout: Path,
    stderr: Path,
    env: dict[str, str],
    fork: bool,
    cores: list[int] | None = None,
) -> TrialProcess:
    """``overlapkit`` with the arguments ``command``, in a session of its own;
    ``cores``: the only cores it (and every process it starts) may run on."""
    if not fork:
        with open(stdout, "wb") as out, open(stderr, "wb") as err:
            return subprocess.Popen(
                [*_launcher(cores), sys.executable, "-m", "overlapkit", *command],
                stdout=out,
                stderr=err,
                start_new_session=True,
                env=env,
            )
    start_server()
    process = multiprocessing.get_context("forkserver").Process(
        target=command_main,
        args=(command, str(stdout), str(stderr), env, None, cores, os.getpid()),
        daemon=False,
    )
    with _FORKED:
        process.start()
    return _Forked(process)


def start_server() -> None:
    """Start the server CPU trials are forked from, once: its imports (seconds) then
    overlap tune's own set-up, when tune starts it before its trials. The environment
    changes for that start only (another thread copying it then met a name without
    its value: a KeyError)."""
    global _server_started
    with _FORKED:
        if _server_started:
            return
        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
        with resource_tracker_quiet():
            multiprocessing.forkserver.ensure_running()
        _server_started = True


class _Forked:
    """A forkserver child with the part of `subprocess.Popen` a trial uses."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self.process = process
        self.pid = process.pid or 0

    def poll(self) -> int | None:
        with _FORKED:
            return None if self.process.is_alive() else self.process.exitcode

    def wait(self) -> int:
        while (code := self.poll()) is None:
            time.sleep(0.02)
        return code


# Execs the interpreter of its third argument, killed when its parent (tune) dies and
# pinned to the cores of its first argument (if any): an isolated `-S` Python starts
# in milliseconds, and both survive exec.
_LAUNCH = """import ctypes, os, sys
ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
if os.getppid() != int(sys.argv[2]):  # tune died before that
    os._exit(1)
if sys.argv[1]:
    os.sched_setaffinity(0, map(int, sys.argv[1].split(",")))
os.execv(sys.argv[3], sys.argv[3:])"""


def _launcher(cores: list[int] | None) -> list[str]:
    """The command prefix that makes what follows it die with tune (a trial left
    running by a killed tune would slow the next one's trials) and run on ``cores``."""
    if not sys.platform.startswith("linux"):
        return []
    pinned = ",".join(map(str, cores or []))
    return [sys.executable, "-I", "-S", "-c", _LAUNCH, pinned, str(os.getpid())]


def command_main(
    command: list[str],
    stdout: str,
    stderr: str,
    env: dict[str, Any],
    cwd: str | None = None,
    cores: list[int] | None = None,
    tune: int | None = None,
) -> None:
    """``overlapkit COMMAND`` in this forked process, as a fresh one started from a shell
    would run it: its own session, output files, environment (and folder), on
    ``cores`` if given; its exit status. It does not return. With its ranks it dies
    with process ``tune``: a trial left running by a killed tune would slow the next
    one's trials (the server it was forked from lives as long as it does)."""
    os.setsid()  # its own process group: the watcher kills it with all its ranks
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignored it
    for fd, path in ((1, stdout), (2, stderr)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    if tune is not None:
        die_with(tune)
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)  # torch's threads start later, and inherit it
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = ["overlapkit", *command]
    from ..cli import main

    code = 1
    try:
        code = main(command)
    except SystemExit as done:  # argparse's usage errors: 2, as from a fresh interpreter
        code = done.code if isinstance(done.code, int) else int(done.code is not None)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # what a fresh process would return; its work is on disk
