"""`overlapkit ARGS` as a process of its own, forked from a server that imported
torch and overlapkit once: the way `overlapkit tune` starts its trials
(`overlapkit.tuning.trial_process`). A fresh interpreter spends ~2 s of a 2-core
machine importing them before the command starts, and the suite runs ~100 commands.

The child is what a shell would start: its own session and process group, the
caller's environment and folder, standard output and error of its own, the
command's exit status (argparse's 2 included). Its ranks are fresh interpreters,
as from the command line. Tests that signal a command start it with `subprocess`.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

PRELOAD = ["torch", "torch._dynamo", "overlapkit.cli", "overlapkit.run", "forked_cli"]


def run(args: list[str], timeout: float, cwd: Path) -> subprocess.CompletedProcess:
    """Like ``subprocess.run([python, -m, overlapkit, *args], capture_output=True,
    text=True, timeout=timeout, cwd=cwd)``."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory(prefix="okcli") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        child = context.Process(
            target=_main, args=(args, str(out), str(err), dict(os.environ), str(cwd))
        )
        child.start()
        child.join(timeout)
        if child.exitcode is None:  # as subprocess.run: killed, then TimeoutExpired
            os.killpg(child.pid, signal.SIGKILL)
            child.join()
            raise subprocess.TimeoutExpired(args, timeout, _text(out), _text(err))
        return subprocess.CompletedProcess(args, child.exitcode, _text(out), _text(err))


def _text(path: Path) -> str:
    """What the child wrote there ("" if it died before it opened the file)."""
    return path.read_text(errors="replace") if path.exists() else ""


def _main(args: list[str], stdout: str, stderr: str, env: dict[str, str], cwd: str) -> None:
    os.setsid()
    for fd, path in ((1, stdout), (2, stderr)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = ["overlapkit", *args]
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
    code = 1
    try:
        from overlapkit.console import main

        code = main()
    except SystemExit as done:  # argparse: usage errors (2), --help (0)
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
