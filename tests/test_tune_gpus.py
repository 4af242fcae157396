"""overlapkit tune on a machine with GPUs: parallel workers get disjoint GPUs
(through CUDA_VISIBLE_DEVICES), and too few GPUs is an error before anything runs.
There is no GPU here: these test the split and where the ids go, not CUDA."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from conftest import TINY_SCENARIO
from overlapkit.runtime.cores import available
from overlapkit.scenarios import Scenario, load_scenario
from overlapkit.tuning import TuneConfig, TuneError, commands, runner, trial, trial_process
from overlapkit.tuning.cores import split_cores
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


def test_trials_running_at_once_hold_disjoint_gpus_and_cores(tmp_path, monkeypatch):
    """Three workers (threads of tune), three trials held until all three run at once:
    each holds a worker's GPUs and cores of its own, the split's."""
    gpus, cores = split_gpus(3, 2, UUIDS), split_cores(3, list(range(7)))
    held, together = [], threading.Barrier(3)

    def fake_trial(data, folder, timeout_s, on_step=None, gpus=None, cores=None):
        held.append((gpus, cores))
        together.wait(timeout=60)  # broken (and the test failed) unless three run at once
        raise trial.TrialFailed("crashed", "a fake trial")

    monkeypatch.setattr(runner, "run_trial", fake_trial)
    folder = tmp_path / "tune"
    config = TuneConfig(trials=3, references=False, repeats=1, prune=False)
    base = {**yaml.safe_load(TINY_SCENARIO), "optimizations": {"prefetch": {"workers": 2}}}
    job = TuneJob(base, config, folder, default_storage(folder), "tiny")
    runner.tune(job, workers=3, console=Console(quiet=True), gpus=gpus, cores=cores)
    assert sorted(held) == sorted(zip(gpus, cores, strict=True))
    every = [gpu for ids, _ in held for gpu in ids]
    assert len(set(every)) == len(every) == 6
    assert cores == [[0, 1, 2], [3, 4], [5, 6]]


HYPERTHREADS = {c: f"{c % 4},{c % 4 + 4}" for c in range(8)}  # cpu i and i+4: one core


@pytest.mark.parametrize(
    ("workers", "cores", "siblings", "expected"),
    [
        (1, [0, 1, 2, 3], None, None),  # one worker: its trials see every core
        (2, [0, 1], None, [[0], [1]]),
        (2, [0, 1, 2, 3, 4], None, [[0, 1, 2], [3, 4]]),
        (3, [4, 5, 9, 10, 11, 12], None, [[4, 5], [9, 10], [11, 12]]),  # an affinity
        (4, [0, 1, 2], None, [[0], [1], [2], [0]]),  # fewer cores: one each in turn
        # A physical core's two hardware threads go to one worker, not one each.
        (2, list(range(8)), HYPERTHREADS, [[0, 1, 4, 5], [2, 3, 6, 7]]),
        (3, list(range(8)), HYPERTHREADS, [[0, 1, 4, 5], [2, 6], [3, 7]]),
        (2, [0, 4], HYPERTHREADS, [[0], [4]]),  # one physical core: its threads apart
    ],
)
def test_each_worker_gets_its_own_cores(workers, cores, siblings, expected):
    told = (lambda core: str(core)) if siblings is None else siblings.__getitem__
    assert split_cores(workers, cores, told) == expected


def test_a_trial_runs_on_its_workers_cores_only(tmp_path):
    """Both ways a trial starts, forked (CPU) and a fresh interpreter (GPUs): its run
    sees only the cores given (the summary counts them)."""
    data = trial.trial_scenario(yaml.safe_load(TINY_SCENARIO), steps=2, warmup_steps=1)
    one = available()[:1]  # a core this process may use
    forked = trial.run_trial(data, tmp_path / "forked", 120, cores=one)
    fresh = trial.run_trial(data, tmp_path / "fresh", 120, gpus=["0"], cores=one)
    for summary in (forked, fresh):
        assert summary["hardware"]["nodes"][0]["cpu_cores"] == 1


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

    def fake_tune(job, workers, timeout_s, console, gpus, ray=None, cores=None):
        given.update(workers=workers, gpus=gpus, cores=cores)
        raise SystemExit("ran")

    monkeypatch.setattr(commands, "tune", fake_tune)
    monkeypatch.setattr(commands, "available", lambda: list(range(8)))  # 8 cores
    return scenario, given


def test_tune_command_splits_the_gpus_among_workers(cuda_scenario, tmp_path, monkeypatch):
    scenario, given = cuda_scenario
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(UUIDS[:5]))
    with pytest.raises(SystemExit):
        commands.tune_command(scenario, tune_args(tmp_path / "tune", 2), Console(quiet=True))
    cores = split_cores(2, list(range(8)))  # as this machine groups its cores
    assert given == {"workers": 2, "gpus": [UUIDS[0:2], UUIDS[2:4]], "cores": cores}


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
    assert given == {"workers": 1, "gpus": [["3", "5"]], "cores": None}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(TuneError, match="need 2 GPUs, but 1 are visible"):
        commands.tune_command(scenario, tune_args(tmp_path / "t2", 1), Console(quiet=True))
