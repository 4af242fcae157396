"""One trial: the scenario with one setting, run as ``overlapkit run`` in processes
of its own (its own process group, its own port), watched step by step.

A crash, an out-of-memory kill or a hang ends that trial only; its reason is
kept. The live step log lets the caller stop a clearly bad trial early.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from ..launch.interrupt import stop_if_asked
from ..runtime.distributed import resolve_device
from ..runtime.report import LIVE_STEPS, LiveSteps
from .trial_process import TrialProcess, start_trial_process

POLL_S = 0.2
CHECKPOINTS = "checkpoints"  # a trial's checkpoint folder, inside its run folder
REASON_CHARS = 1500


NODE_LOST = "node_lost"  # a machine of the trial's run went away (its setting runs again)


class TrialFailed(RuntimeError):
    """The trial's run failed; ``kind`` is invalid, crashed, killed, out_of_memory,
    timeout or node_lost."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"{kind}: {reason}")
        self.kind, self.reason = kind, reason


class TrialStopped(RuntimeError):
    """The watcher asked to stop the trial (it is being pruned)."""


def trial_scenario(data: dict[str, Any], steps: int, warmup_steps: int) -> dict[str, Any]:
    """A trial's scenario: the measured window of the tuner, no evaluation, a fresh
    start, and checkpoints (if any) inside the trial's own folder."""
    data = json.loads(json.dumps(data))
    train = data.setdefault("train", {})
    train.update(steps=steps, warmup_steps=warmup_steps, eval={"every": 0, "at_end": False})
    checkpoint = (data.get("optimizations") or {}).get("checkpoint")
    if checkpoint is not None:
        checkpoint.update(dir=CHECKPOINTS, resume=False, final=False)
    data.pop("tune", None)
    return data


def with_checkpoints(data: dict[str, Any], every: int | None) -> dict[str, Any]:
    """The scenario ``data`` checkpointing every ``every`` steps (None: not at all),
    its other checkpoint knobs (folder, persist priority...) kept; the knobs that
    choose an interval (intensity, auto mode) dropped."""
    data = json.loads(json.dumps(data))
    optimizations = data.setdefault("optimizations", {}) or {}
    data["optimizations"] = optimizations
    if every is None:
        optimizations.pop("checkpoint", None)
        return data
    entry = dict(optimizations.get("checkpoint") or {})
    for knob in ("intensity", "auto", "max_overhead"):
        entry.pop(knob, None)
    optimizations["checkpoint"] = {**entry, "every": int(every)}
    return data


def run_trial(
    data: dict[str, Any],
    folder: Path,
    timeout_s: float,
    on_step: Callable[[int, float], bool] | None = None,
    gpus: list[str] | None = None,
    cores: list[int] | None = None,
) -> dict[str, Any]:
    """Run the trial scenario ``data`` in ``folder``; return its summary.

    ``on_step(measured_steps, samples_per_s_so_far)`` is called as measured steps
    finish; returning True stops the run and raises `TrialStopped`. ``gpus``: the
    only GPUs the run may see (its worker's), else those this process sees;
    ``cores``: the only cores it may run on (its worker's), else this process's.
    """
    folder.mkdir(parents=True, exist_ok=True)
    scenario_file = folder / "scenario.yaml"
    scenario_file.write_text(yaml.safe_dump(data, sort_keys=False))
    run_dir = folder / "run"
    command = ["run", str(scenario_file), "--out", str(run_dir), "--quiet", "--fresh"]
    stderr_path = folder / "stderr.txt"
    on_cpu = gpus is None and trials_on_cpu(data)
    process = start_trial_process(
        command, folder / "stdout.txt", stderr_path, _child_env(gpus), fork=on_cpu, cores=cores
    )
    try:
        _watch(process, run_dir / LIVE_STEPS, timeout_s, on_step)
    finally:
        returncode = _kill_group(process)
    _remove_checkpoints(run_dir)
    if returncode != 0:
        # A process that died before its run started may have written nothing.
        said = stderr_path.read_text(errors="replace") if stderr_path.exists() else ""
        raise failure_of(returncode, said)
    return json.loads((run_dir / "summary.json").read_text())


def trials_on_cpu(data: dict[str, Any]) -> bool:
    """Whether the scenario ``data`` runs on the CPU (its trials are forked, then)."""
    return resolve_device((data.get("world") or {}).get("device", "auto")) == "cpu"


def _child_env(gpus: list[str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("TORCHELASTIC_RUN_ID", None)  # a trial is a run of its own, never part of ours
    if gpus is not None:
        # Set for the run only: a worker in the tune process itself keeps its own view.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return env


class StepWatch:
    """Reads the live step log as it grows and asks ``on_step(measured_steps,
    samples_per_s_so_far)`` after each measured step whether to stop."""

    def __init__(self, on_step: Callable[[int, float], bool] | None) -> None:
        self.on_step = on_step
        self.seen, self.samples, self.seconds = 0, 0.0, 0.0

    def feed(self, text: str) -> bool:
        """Complete lines of the log; True when the run should stop."""
        for line in text.splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            if record["warmup"]:
                continue
            self.seen += 1
            self.samples += record["samples_per_s"] * record["step_time_s"]
            self.seconds += record["step_time_s"]
            if self.on_step and self.seconds > 0:
                if self.on_step(self.seen, self.samples / self.seconds):
                    return True
        return False


def _watch(
    process: TrialProcess,
    live: Path,
    timeout_s: float,
    on_step: Callable[[int, float], bool] | None,
) -> None:
    deadline = time.monotonic() + timeout_s
    watch, offset = StepWatch(on_step), 0
    while process.poll() is None:
        if time.monotonic() > deadline:
            _kill_group(process)
            raise TrialFailed("timeout", f"no result within {timeout_s:g} s")
        time.sleep(POLL_S)
        stop_if_asked()  # tune was stopped (Ctrl-C): `run_trial` kills the trial
        if on_step is None:
            continue
        text, offset = LiveSteps.read_new(live, offset)
        if watch.feed(text):
            _kill_group(process)
            raise TrialStopped


def _kill_group(process: TrialProcess) -> int:
    """Stop the run and every process it started (its ranks, their loader workers);
    return its exit status."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return process.wait()


def _remove_checkpoints(run_dir: Path) -> None:
    shutil.rmtree(run_dir / CHECKPOINTS, ignore_errors=True)


def failure_of(returncode: int, stderr: str) -> TrialFailed:
    lines = [line for line in stderr.splitlines() if line.strip()]
    tail = "\n".join(lines[-12:])[-REASON_CHARS:] or "(nothing on stderr)"
    if returncode == 2:
        return TrialFailed("invalid", tail)
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = " (out of memory?)" if -returncode == signal.SIGKILL else ""
        return TrialFailed("killed", f"killed by {name}{hint}\n{tail}")
    if "out of memory" in stderr.lower() or "MemoryError" in stderr:
        return TrialFailed("out_of_memory", tail)
    return TrialFailed("crashed", f"exit status {returncode}\n{tail}")
