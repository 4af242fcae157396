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
import tempfile
from pathlib import Path

from overlapkit.tuning.trial_process import PRELOAD, command_main


def run(args: list[str], timeout: float, cwd: Path) -> subprocess.CompletedProcess:
    """Like ``subprocess.run([python, -m, overlapkit, *args], capture_output=True,
    text=True, timeout=timeout, cwd=cwd)``."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory(prefix="okcli") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        child = context.Process(
            target=command_main, args=(args, str(out), str(err), dict(os.environ), str(cwd))
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
