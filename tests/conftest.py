from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).parent
ROOT = TESTS.parent
PLUGINS = TESTS / "plugins"

# Tests play Ctrl-C (SIGINT) on the commands they start. A runner that started pytest
# in the background (`nohup ... &` without job control) left SIGINT ignored, and every
# child would inherit that and never stop: restore it (children then start with it).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The toy optimizations are visible to this process and to every rank it starts.
os.environ["OVERLAPKIT_PLUGINS"] = "toy_plugins"
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(PLUGINS), *filter(None, [os.environ.get("PYTHONPATH")])]
)
sys.path.insert(0, str(PLUGINS))

TINY_SCENARIO = """
name: tiny
model: {name: resnet18, stem: cifar, num_classes: 4, width: 4}
data: {name: synthetic-images, shape: [3, 16, 16], num_classes: 4, num_samples: 256, eval_samples: 64}
train:
  batch_size: 8
  steps: 6
  warmup_steps: 2
  optimizer: {name: sgd, lr: 0.05, momentum: 0.9}
  seed: 0
world: {nprocs: 1}
"""


@pytest.fixture
def tiny_scenario(tmp_path: Path):
    """Write a scenario file: the tiny one, or the given YAML text."""

    def write(text: str = TINY_SCENARIO, name: str = "scenario.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write


class FakeClock:
    """The runtime's clock, moved only by `sleep` (and by ``tick`` at every reading):
    times measured by the runtime are then exact, whatever the machine is doing."""

    def __init__(self, tick: float = 0.0) -> None:
        self.now, self.tick = 1000.0, tick
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        self.now += self.tick
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def fake_clock(monkeypatch):
    """Replace ``perf_counter`` in the runtime's modules that time steps, phases,
    pauses and hooks; the test moves time on with ``fake_clock.sleep``."""
    from overlapkit.runtime import epochs, scheduler, session, timing

    clock = FakeClock()
    for module in (timing, epochs, session, scheduler):
        monkeypatch.setattr(module, "perf_counter", clock)
    return clock


def run_cli(
    *args: str, timeout: float = 240, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """`overlapkit ARGS` in a process of its own, its output captured (`forked_cli`:
    forked from a server that imported torch, as the tuner starts its trials)."""
    import forked_cli

    return forked_cli.run([str(a) for a in args], timeout, cwd or ROOT)


def most_at_once(trials) -> int:
    """The most of ``trials`` (Optuna's) that ran at once."""
    events = sorted(
        [(t.datetime_start, 1) for t in trials] + [(t.datetime_complete, -1) for t in trials],
        key=lambda e: (e[0], e[1]),
    )
    now = best = 0
    for _, change in events:
        now += change
        best = max(best, now)
    return best


def step_losses(run: Path) -> dict[tuple[int, int], float]:
    """A run folder's steps.jsonl: (step, rank) -> that rank's loss."""
    records = map(json.loads, (run / "steps.jsonl").read_text().splitlines())
    return {(r["step"], r["rank"]): r["loss"] for r in records}


def cli_here(*args: Any, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`run_cli` in this process: no interpreter and torch to start (~3 s each). For
    commands that only read, check or fail early; a traceback is an error."""
    from overlapkit.cli import main

    out, err = io.StringIO(), io.StringIO()
    place = contextlib.chdir(cwd) if cwd is not None else contextlib.nullcontext()
    with place, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as done:  # argparse's usage errors
            code = done.code
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (ended, or a zombie nobody reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dashboard_get(storage_url: str, path: str):
    """One GET request to optuna-dashboard's WSGI app over the study's storage."""
    import io

    from optuna_dashboard import wsgi

    from overlapkit.tuning.study import open_storage

    app = wsgi(open_storage(storage_url))
    status = []
    environ = {
        "REQUEST_METHOD": "GET", "PATH_INFO": path, "QUERY_STRING": "",
        "SERVER_NAME": "localhost", "SERVER_PORT": "80", "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(), "wsgi.errors": sys.stderr,
    }  # fmt: skip
    body = b"".join(app(environ, lambda s, headers, exc=None: status.append(s)))
    return status[0], body
