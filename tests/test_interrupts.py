"""Ctrl-C and kill on `overlapkit run`: every rank stops, one line says where and how
to resume, and that command resumes exactly. The signals are real: `toy_fail` plays
the user at a chosen step (SIGINT to the whole process group, as a terminal's Ctrl-C
does; SIGTERM to the command), so the test is not a race against the clock."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TINY_SCENARIO, step_losses
from overlapkit.optimizations.checkpoint.fileformat import read as read_checkpoint

COMMON = [
    "--quiet",
    "--set",
    "train.steps=14",
    "--set",
    "train.warmup_steps=0",
    "--set",
    "optimizations.checkpoint={every: 4}",
]
TWO_RANKS = ["--set", "world.nprocs=2", "--set", "optimizations.ddp_overlap.intensity=1"]


def overlapkit(*args: str | Path, cwd: Path = ROOT, prefix: list[str] | None = None):
    """The CLI in a session of its own, so that a Ctrl-C to its group spares pytest."""
    command = prefix or [sys.executable, "-m", "overlapkit"]
    return subprocess.run(
        [*command, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
        start_new_session=True,
    )


def stopped_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("overlapkit: stopped by")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def resume_command(line: str) -> list[str]:
    words = shlex.split(line.split("Resume: ", 1)[1])
    assert words[0] == "overlapkit"
    return words[1:]


def final_model(run: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(run / "checkpoints" / "step-00000014" / "shared.ckpt")["model"]


@pytest.mark.slow
def test_ctrl_c_on_two_ranks_prints_a_command_that_resumes_bit_identically(tiny_scenario, tmp_path):
    scenario = tiny_scenario()
    straight = overlapkit("run", scenario, "--out", tmp_path / "a", *COMMON, *TWO_RANKS)
    assert straight.returncode == 0, straight.stderr[-2000:]
    ctrl_c = "optimizations.toy_fail={rank: 1, step: 9, how: sigint}"
    out = tmp_path / "b"
    stopped = overlapkit("run", scenario, "--out", out, *COMMON, *TWO_RANKS, "--set", ctrl_c)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr and "Error" not in stopped.stderr, stopped.stderr
    line = stopped_line(stopped.stderr)
    assert "stopped by SIGINT at step" in line and f"run folder {out}" in line
    assert "the newest checkpoint is step 4" in line or "is step 8" in line, line
    resumed = overlapkit(*resume_command(line))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    resumed_from = summary["optimizations"]["checkpoint"]["resumed_from_step"]
    assert resumed_from in (4, 8) and f"step {resumed_from}" in line
    again, first = step_losses(out), step_losses(tmp_path / "a")
    assert set(again) == {(s, r) for s in range(resumed_from, 14) for r in (0, 1)}
    assert all(first[key] == loss for key, loss in again.items())
    a, b = final_model(tmp_path / "a"), final_model(out)
    assert all(torch.equal(a[name], b[name]) for name in a)


@pytest.mark.slow
def test_kill_of_a_one_rank_run_exits_143_and_run_resume_continues_its_folder(
    tiny_scenario, tmp_path
):
    scenario = tiny_scenario()
    kill = "optimizations.toy_fail={rank: 0, step: 9, how: sigterm}"
    stopped = overlapkit("run", scenario, *COMMON, "--set", kill, cwd=tmp_path)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    line = stopped_line(stopped.stderr)
    # The interrupted step did not happen: 9 steps done, the step-8 checkpoint or 4.
    assert "stopped by SIGTERM at step 9" in line, line
    (folder,) = (tmp_path / "runs").iterdir()
    assert f"run folder runs/{folder.name}" in line
    assert stopped.stderr.startswith(f"overlapkit: run folder runs/{folder.name}")

    fresh = overlapkit("run", scenario, *COMMON, "--set", "train.steps=2", cwd=tmp_path)
    assert "--resume continues it" in fresh.stderr  # a new folder is not made silently
    os.utime(folder / "scenario.yaml")  # the interrupted run is the newest again

    resumed = overlapkit("run", scenario, *COMMON, "--resume", "--json", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads(resumed.stdout)
    assert summary["run_dir"] == f"runs/{folder.name}"
    assert summary["optimizations"]["checkpoint"]["resumed_from_step"] in (4, 8)
    assert f"overlapkit: results in runs/{folder.name}" in resumed.stderr


def test_resume_without_an_earlier_run_or_with_out_is_a_usage_error(tiny_scenario, tmp_path):
    scenario = tiny_scenario(TINY_SCENARIO + "optimizations: {checkpoint: {every: 2}}\n")
    alone = overlapkit("run", scenario, "--resume", cwd=tmp_path)
    assert alone.returncode == 2 and "no earlier run of tiny" in alone.stderr
    never = overlapkit("run", tiny_scenario(name="plain.yaml"), "--resume", cwd=tmp_path)
    assert never.returncode == 2 and "tiny does not checkpoint" in never.stderr
    fresh_always = TINY_SCENARIO + "optimizations: {checkpoint: {resume: false}}\n"
    over = overlapkit("run", tiny_scenario(fresh_always, name="f.yaml"), "--resume", cwd=tmp_path)
    assert over.returncode == 2 and "has resume: false" in over.stderr
    both = overlapkit("run", scenario, "--resume", "--out", tmp_path / "x", cwd=tmp_path)
    assert both.returncode == 2 and "--out names one" in both.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "x").exists()


@pytest.mark.slow
def test_ctrl_c_under_torchrun_stops_both_ranks_with_the_resume_line(tiny_scenario, tmp_path):
    # torchrun looks at its ranks once a second: rank 0 sees rank 1 leave (its all-reduce
    # fails) before torchrun's SIGTERM reaches it, and must still stop as interrupted.
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--monitor-interval", "1", "--nproc-per-node", "2", "-m", "overlapkit"]
    ctrl_c = "optimizations.toy_fail={rank: 1, step: 5, how: sigint}"
    out = tmp_path / "t"
    stopped = overlapkit(
        "run", tiny_scenario(), "--out", out, *COMMON, *TWO_RANKS, "--set", ctrl_c, prefix=torchrun
    )
    assert stopped.returncode != 0
    line = stopped_line(stopped.stderr)  # rank 0's, once
    assert "stopped by SIG" in line and f"--out {out}" in line and "torchrun" in line
    # The ranks themselves end without a traceback (torchrun's own agent may print one).
    assert "RunInterrupted" not in stopped.stderr and "KeyboardInterrupt" not in stopped.stderr


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_ctrl_c_stops_tune_quietly_and_the_stopped_trial_runs_again(
    tiny_scenario, tmp_path, workers
):
    import optuna

    from overlapkit.tuning.study import TuneJob, open_storage

    slow = TINY_SCENARIO.replace("eval_samples: 64}", "eval_samples: 0, sample_cost_ms: 40}")
    scenario = tiny_scenario(slow + "optimizations: {checkpoint: {}}\ntune: {trials: 1}\n")
    folder = tmp_path / "tune"
    command = [sys.executable, "-m", "overlapkit", "tune", str(scenario), "--out", str(folder)]
    tune = subprocess.Popen(
        [*command, "--workers", str(workers)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    live = list(folder.glob("trials/*/run/live-steps.jsonl"))
    while not any(p.read_text().strip() for p in live) and tune.poll() is None:
        time.sleep(0.2)  # until a trial has measured a step
        live = list(folder.glob("trials/*/run/live-steps.jsonl"))
    os.killpg(tune.pid, signal.SIGINT)  # Ctrl-C reaches the terminal's whole group
    _, stderr = tune.communicate(timeout=120)
    assert tune.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert "tune stopped" in stderr and "the same command continues it" in stderr
    study = optuna.load_study(
        study_name="tiny", storage=open_storage(TuneJob.load(folder).storage_url)
    )
    stopped = [t for t in study.trials if t.user_attrs.get("failure") == "interrupted"]
    assert stopped, [(t.number, t.state, t.user_attrs) for t in study.trials]
    # Every trial that ran was stopped and recorded, none left running.
    assert not [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    waiting = [t for t in study.trials if t.state == optuna.trial.TrialState.WAITING]
    for trial in stopped:  # each queued again with its setting and role
        assert any(
            w.system_attrs.get("fixed_params") == trial.params
            and w.user_attrs.get("role") == trial.user_attrs["role"]
            for w in waiting
        ), (trial.params, [w.system_attrs for w in waiting])


def test_trials_ctrl_c_stopped_mid_bookkeeping_end_tune_quietly():
    """Seen once in CI: Ctrl-C stopped a trial, then Optuna's record of it failed
    ("Cannot tell a FAIL trial") and a traceback was printed. Ctrl-C reaches tune's
    main thread only; the trials' thread is told, and stops. Such an error after it
    is one line, and tune stops as Ctrl-C asked; without Ctrl-C it is raised."""
    from rich.console import Console

    from overlapkit.launch.interrupt import stop_if_asked
    from overlapkit.tuning import runner

    waiting = threading.Event()  # the main thread waits for the trials' thread

    def stopped_then_failed():
        assert waiting.wait(timeout=60)
        os.kill(os.getpid(), signal.SIGINT)  # the main thread's Ctrl-C
        try:
            for _ in range(3000):  # a trial's watch, told by the main thread to stop
                stop_if_asked()
                time.sleep(0.01)
        except KeyboardInterrupt:
            raise ValueError("Cannot tell a FAIL trial.") from None  # Optuna's record
        raise AssertionError("the trials' thread was never told to stop")

    def failed():
        raise ValueError("a bug")

    said = io.StringIO()
    kept = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            runner._in_threads(stopped_then_failed, waiting.set, Console(file=said))
        assert "stopped while recording a trial: Cannot tell" in said.getvalue()
        stop_if_asked()  # no longer stopping: the next tune's trials run
        with pytest.raises(ValueError, match="a bug"):
            runner._in_threads(failed, lambda: None, Console(file=said))
    finally:
        signal.signal(signal.SIGINT, kept)


def test_ctrl_c_three_times_quits_a_tune_whose_trials_do_not_stop():
    """A trial waiting on a machine that never answers never sees tune's stop: tune
    waited for it through every Ctrl-C. Each Ctrl-C is said; the third quits at once."""
    program = textwrap.dedent(
        """
        import io, os, signal, sys, threading
        from rich.console import Console
        from overlapkit.tuning import runner

        class Terminal(io.StringIO):  # at each new line that says so, Ctrl-C again
            said = set()

            def write(self, text):
                sys.stderr.write(text)
                for left in ("2 more times", "1 more time"):
                    if left in text and left not in self.said:
                        self.said.add(left)
                        os.kill(os.getpid(), signal.SIGINT)
                return len(text)

        def stuck():  # never looks at the stop
            threading.Event().wait(120)

        def first_ctrl_c():
            os.kill(os.getpid(), signal.SIGINT)

        runner._in_threads(stuck, first_ctrl_c, Console(file=Terminal(), width=200))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 130, result.stderr[-3000:]
    assert "stopping the trials (Ctrl-C 2 more times quits at once)" in result.stderr
    assert "stopping the trials (Ctrl-C 1 more time quits at once)" in result.stderr
    assert "tune quit; the next tune queues its trials again" in result.stderr
    assert "Traceback" not in result.stderr


def test_only_a_collective_a_peer_left_waits_for_the_launchers_signal():
    """A rank's own error is reported at once (every failing multi-rank run waited 3 s,
    and a second rank's error could be taken for a stop); a peer gone is waited on."""
    from overlapkit.launch.interrupt import peer_left

    gloo = "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:17805"
    assert peer_left(RuntimeError(gloo))
    assert peer_left(RuntimeError("Connection reset by peer"))
    assert not peer_left(RuntimeError("toy failure on rank 1 at step 3"))
    assert not peer_left(OSError("No space left on device"))
    assert not peer_left(KeyboardInterrupt())


def test_new_ranks_hold_ctrl_c_until_the_run_takes_it(tmp_path):
    """A rank spends its first seconds importing torch before any code of ours runs: a
    Ctrl-C there printed a KeyboardInterrupt traceback per rank. The launcher's ranks
    now start with SIGINT blocked, and it is unblocked before the rank's function runs."""
    import multiprocessing.spawn

    from plugins.rank_programs import sigint_held

    from overlapkit.launch.interrupt import ranks_hold_ctrl_c_until_ready
    from overlapkit.launch.local import launch_local

    before = multiprocessing.spawn.get_executable()
    with ranks_hold_ctrl_c_until_ready(tmp_path):
        interpreter = os.fsdecode(multiprocessing.spawn.get_executable())
        assert interpreter == str(tmp_path / "python")
        blocked = "import signal; print(signal.SIGINT in signal.pthread_sigmask(0, []))"
        started = subprocess.run([interpreter, "-c", blocked], capture_output=True, text=True)
        assert started.stdout == "True\n", started.stderr
    assert multiprocessing.spawn.get_executable() == before  # the launcher's own again
    assert launch_local(sigint_held, 2) == {0: False, 1: False}  # released for the run
    with ranks_hold_ctrl_c_until_ready(tmp_path / "missing"):  # a script that cannot run
        assert multiprocessing.spawn.get_executable() == before


@pytest.mark.slow
def test_ctrl_c_while_the_ranks_import_is_one_line(tiny_scenario, tmp_path):
    """Ctrl-C as soon as the ranks exist (they are importing torch for a second or
    more): the stop line, no traceback."""
    command = [
        sys.executable,
        "-m",
        "overlapkit",
        "run",
        tiny_scenario(),
        "--out",
        tmp_path / "run",
    ]
    launcher = subprocess.Popen(
        [*map(str, command), *TWO_RANKS, "--quiet"],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )

    def ranks() -> list[str]:  # the launcher's children, whichever of its threads started them
        tasks = Path(f"/proc/{launcher.pid}/task").glob("*/children")
        with contextlib.suppress(OSError):
            pids = [pid for task in tasks for pid in task.read_text().split()]
            return [p for p in pids if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
        return []

    def importing_torch(pid: str) -> bool:  # its interpreter runs: torch's library is loaded
        with contextlib.suppress(OSError):
            return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
        return False

    deadline = time.monotonic() + 120
    while launcher.poll() is None and time.monotonic() < deadline:
        started = ranks()
        if len(started) == 2 and all(importing_torch(pid) for pid in started):
            break
        time.sleep(0.01)
    assert launcher.poll() is None, "the run ended before its ranks were seen"
    os.killpg(launcher.pid, signal.SIGINT)
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert "stopped by SIGINT" in stopped_line(stderr)
    assert not (tmp_path / "run" / "summary.json").exists()  # stopped, not run to its end
