"""overlapkit tune on a machine with GPUs: parallel workers get disjoint GPUs
(through CUDA_VISIBLE_DEVICES), and too few GPUs is an error before anything runs.
There is no GPU here: these test the split and where the ids go, not CUDA."""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from conftest import TINY_SCENARIO
from overlapkit.scenarios import Scenario, load_scenario
from overlapkit.tuning import TuneConfig, TuneError, commands, runner, trial, trial_process
from overlapkit.tuning.gpus import split_gpus, visible_gpus
from overlapkit.tuning.study import TuneJob, default_storage

UUIDS = [f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}" for i in range(6)]


@pytest.mark.parametrize(
    ("workers", "ranks", "visible"),
    [
        (1, 1, ["0"]),
        (2, 1, ["0", "1"]),
        (2, 2, ["0", "1", "2", "3"]),
        (4, 2, [str(i) for i in range(8)]),
        (3, 1, ["0", "1", "2", "3", "4"]),  # two left over
        (2, 3, UUIDS),
        (3, 2, UUIDS),
        (2, 2, ["3", "5", "6", "7"]),  # a parent already restricted to a subset
    ],
)
def test_each_worker_gets_its_own_gpus_one_per_rank(workers, ranks, visible):
    split = split_gpus(workers, ranks, visible)
    assert len(split) == workers
    assert all(len(ids) == ranks for ids in split)
    every = [gpu for ids in split for gpu in ids]
    assert len(set(every)) == len(every) == workers * ranks  # disjoint
    assert set(every) <= set(visible)  # only the GPUs the parent sees, named as it does
    assert every == visible[: workers * ranks]  # in order; the rest unused


@pytest.mark.parametrize(
    ("workers", "ranks", "visible"),
    [(3, 2, ["0", "1", "2", "3"]), (2, 1, ["0"]), (2, 4, UUIDS), (2, 1, [])],
)
def test_too_many_workers_times_ranks_is_a_clear_error(workers, ranks, visible):
    with pytest.raises(TuneError) as raised:
        split_gpus(workers, ranks, visible)
    message = str(raised.value)
    assert f"{workers} workers" in message
    assert f"{ranks} ranks" in message
    assert f"{workers * ranks} GPUs" in message
    assert f"{len(visible)} are visible" in message
    assert "--workers" in message and "world.nprocs" in message


def test_visible_gpus_are_the_parents_view():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3,5, 6,7"}) == ["3", "5", "6", "7"]
    uuids = ",".join(UUIDS[:2])
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": uuids}) == UUIDS[:2]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []  # set but empty: none


def test_without_cuda_visible_devices_every_gpu_torch_counts(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert visible_gpus({}) == ["0", "1", "2"]


def test_a_parent_subset_is_split_by_its_ids(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,4,6,7")
    assert split_gpus(2, 2, visible_gpus()) == [["2", "4"], ["6", "7"]]


# --------------------------------------------------------------- where the ids go
def test_a_trial_run_sees_only_its_workers_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert trial._child_env(["2", "3"])["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert trial._child_env(UUIDS[1:3])["CUDA_VISIBLE_DEVICES"] == ",".join(UUIDS[1:3])
    assert trial._child_env()["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # none given: inherited
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # the tune process keeps its own


def test_in_process_worker_starts_its_trials_with_its_gpus(tmp_path, monkeypatch):
    """tune with one worker (in this process) and its GPUs: the trial process it
    starts has them in its environment, and this process's environment is unchanged."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    seen = tmp_path / "seen.txt"
    real_popen = subprocess.Popen

    def record_env(command, **kwargs):  # the trial's process, telling what it sees
        script = (
            "import os, sys; open(sys.argv[1], 'w').write(os.environ['CUDA_VISIBLE_DEVICES']); "
            "sys.exit(3)"  # a failed trial: the worker goes on
        )
        return real_popen([sys.executable, "-c", script, str(seen)], **kwargs)

    monkeypatch.setattr(trial_process.subprocess, "Popen", record_env)
    folder = tmp_path / "tune"
    config = TuneConfig(trials=1, references=False, repeats=1, prune=False)
    base = {**yaml.safe_load(TINY_SCENARIO), "optimizations": {"prefetch": {"workers": 2}}}
    job = TuneJob(base, config, folder, default_storage(folder), "tiny")
    runner.tune(job, workers=1, console=Console(quiet=True), gpus=[["6", "7"]])
    assert seen.read_text() == "6,7"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"


class FakeProcess:
    """Stands in for a spawned worker: keeps the arguments it was started with."""

    started: list[tuple] = []

    def __init__(self, target, args, daemon):
        self.args, self.exitcode = args, 0

    def start(self):
        FakeProcess.started.append(self.args)

    def is_alive(self):
        return False

    def join(self):
        pass


def test_parallel_workers_are_started_with_disjoint_gpus(monkeypatch):
    class Context:
        Process = FakeProcess

    FakeProcess.started = []
    monkeypatch.setattr(runner.multiprocessing, "get_context", lambda method: Context)
    monkeypatch.setattr(runner.Shown, "new", lambda *args: None)
    split = split_gpus(3, 2, UUIDS)
    shown = runner.Shown(set(), Console(quiet=True))
    runner._round(None, None, 7, runner.Pool(3, split), None, shown, queued=False)
    # worker_main's last argument (they travel pickled: `worker_start`)
    gpus = [pickle.loads(args[0])[-1] for args in FakeProcess.started]
    assert gpus == split
    every = [gpu for ids in gpus for gpu in ids]
    assert len(set(every)) == len(every) == 6


# ------------------------------------------------------------------ tune command
def tune_args(out: Path, workers: int) -> argparse.Namespace:
    return argparse.Namespace(
        trials=None,
        storage=None,
        study=None,
        workers=workers,
        timeout=None,
        out=out,
        json=False,
        ray=None,
        max_concurrent=None,
    )


@pytest.fixture
def cuda_scenario(tiny_scenario, monkeypatch):
    """The tiny scenario on CUDA, 2 ranks per trial; its set-up check (which needs a
    GPU) passes, and tune records what it was given instead of running."""
    text = TINY_SCENARIO.replace("world: {nprocs: 1}", "world: {nprocs: 2, device: cuda}")
    text += "optimizations: {prefetch: {workers: 2}}\n"
    scenario = load_scenario(tiny_scenario(text))
    monkeypatch.setattr(Scenario, "check_setup", lambda self, world_size=None, gpus_here=True: None)
    given = {}

    def fake_tune(job, workers, timeout_s, console, gpus, ray=None):
        given.update(workers=workers, gpus=gpus)
        raise SystemExit("ran")

    monkeypatch.setattr(commands, "tune", fake_tune)
    return scenario, given


def test_tune_command_splits_the_gpus_among_workers(cuda_scenario, tmp_path, monkeypatch):
    scenario, given = cuda_scenario
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(UUIDS[:5]))
    with pytest.raises(SystemExit):
        commands.tune_command(scenario, tune_args(tmp_path / "tune", 2), Console(quiet=True))
    assert given == {"workers": 2, "gpus": [UUIDS[0:2], UUIDS[2:4]]}


def test_tune_command_with_too_few_gpus_stops_before_any_trial(
    cuda_scenario, tmp_path, monkeypatch
):
    scenario, given = cuda_scenario
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(TuneError, match="2 workers x 2 ranks .* need 4 GPUs, but 3 are visible"):
        commands.tune_command(scenario, tune_args(tmp_path / "tune", 2), Console(quiet=True))
    assert given == {}  # no worker started
    assert not (tmp_path / "tune").exists()


def test_one_worker_gets_a_gpu_per_rank_or_a_clear_error(cuda_scenario, tmp_path, monkeypatch):
    """One worker's trials run on the first world.nprocs GPUs; too few is refused before
    anything runs, as `overlapkit run` refuses ranks that would share a GPU."""
    scenario, given = cuda_scenario
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    with pytest.raises(SystemExit):
        commands.tune_command(scenario, tune_args(tmp_path / "tune", 1), Console(quiet=True))
    assert given == {"workers": 1, "gpus": [["3", "5"]]}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(TuneError, match="need 2 GPUs, but 1 are visible"):
        commands.tune_command(scenario, tune_args(tmp_path / "t2", 1), Console(quiet=True))
