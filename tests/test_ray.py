"""overlapkit on a real Ray cluster on this machine (a head without CPUs and two worker
nodes of 2 CPUs, Ray's cluster_utils): studies whose trials span two machines, a
machine lost mid-trial, a driver killed and started again, and one run over two
machines against two local ranks. No mocks: real raylets, actors, placement groups."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
import sqlalchemy
from optuna.trial import TrialState
from pg_server import throwaway_postgres

from conftest import (
    ROOT,
    TINY_SCENARIO,
    cli_here,
    dashboard_get,
    most_at_once,
    run_cli,
    step_losses,
)
from overlapkit.tuning.study import open_storage

pytestmark = pytest.mark.slow

NODE = {"num_cpus": 2, "object_store_memory": 80_000_000}
TUNE = "{trials: %d, references: false, sampler: random, prune: false, steps: %d, warmup_steps: 1, repeats: 1}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from ray.cluster_utils import Cluster

    short = Path(tempfile.mkdtemp(prefix="okr", dir="/tmp"))  # Unix socket paths stay short
    scratch = tmp_path_factory.mktemp("machines")  # where the actors keep their run folders
    env = {
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_TMPDIR": str(short),
        "TMPDIR": str(scratch),
        "RAY_NODE_TYPE_NAME": "fake_cpu_node",  # as the cluster launcher starts its nodes
        # A removed machine is counted out after 3 missed health checks 1 s apart
        # (Ray's default: 5 of 3 s, ~15 s of each lost-machine test spent waiting).
        "RAY_health_check_period_ms": "1000",
        "RAY_health_check_timeout_ms": "2000",
        "RAY_health_check_failure_threshold": "3",
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)  # the raylets, their actors and the drivers below inherit it
    ray_cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={
            "num_cpus": 0,
            "object_store_memory": 80_000_000,
            "include_dashboard": False,
        },
    )
    workers = [ray_cluster.add_node(**NODE) for _ in range(2)]
    ray_cluster.wait_for_nodes()
    try:
        yield SimpleNamespace(
            cluster=ray_cluster, workers=workers, address=ray_cluster.address, scratch=scratch
        )
    finally:
        ray_cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(short, ignore_errors=True)


def two_machine_scenario(tiny_scenario, optimizations: str, tune: str = ""):
    text = TINY_SCENARIO.replace("world: {nprocs: 1}", "world: {nprocs: 1, nodes: 2, device: cpu}")
    text += f"optimizations: {optimizations}\n" + (f"tune: {tune}\n" if tune else "")
    return tiny_scenario(text)


def trials_of(storage_url: str, name: str = "tiny"):
    return optuna.load_study(study_name=name, storage=open_storage(storage_url)).trials


def sqlite(folder: Path) -> str:
    return f"sqlite:///{folder / 'study.db'}"


def start_driver(command: list[str], log: Path, session: bool = False) -> subprocess.Popen:
    """`overlapkit COMMAND` as a driver of its own, its output in ``log``; ``session``:
    in a session of its own, as from a terminal (whose Ctrl-C reaches its group)."""
    with log.open("wb") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "overlapkit", *command],
            cwd=ROOT,
            stdout=sink,
            stderr=sink,
            start_new_session=session,
        )


def steps_on_new_machines(cluster) -> Callable[[], bool]:
    """Whether a run started since this call has measured a step on its machines
    (written its live step log in a machine's run folder)."""
    before = set(cluster.scratch.glob("overlapkit-node-*"))

    def measured() -> bool:
        folders = set(cluster.scratch.glob("overlapkit-node-*")) - before
        lives = [f / "run" / "live-steps.jsonl" for f in folders]
        return any(p.exists() and p.stat().st_size > 0 for p in lives)

    return measured


def wait_for(condition, seconds: float, what: str, log: Path | None = None):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    said = f"; the driver's log ends:\n{log.read_text()[-3000:]}" if log else ""
    pytest.fail(f"waited {seconds:g} s for {what}{said}")


# ------------------------------------------------------------------ studies
def test_a_study_of_two_machine_trials_in_postgresql_with_more_in_flight_than_room(
    cluster, tiny_scenario, tmp_path, monkeypatch
):
    """Three trials at most in flight on a cluster that holds two: the third waits for
    room that the study's own trials hold, past the room time-out (it failed as "no
    room" then, and stopped the study)."""
    optimizations = "{ddp_overlap: {intensity: 1}, checkpoint: {every: 2}}"
    tune = TUNE[:-1] % (3, 4) + ", search: {ddp_overlap: null}}"  # checkpoints: every 2
    path = two_machine_scenario(tiny_scenario, optimizations, tune)
    out = tmp_path / "tune"
    monkeypatch.setenv("OVERLAPKIT_RAY_ROOM_TIMEOUT_S", "1")
    with throwaway_postgres() as url:
        result = run_cli(
            "tune", path, "--ray", cluster.address, "--max-concurrent", "3",
            "--storage", url, "--out", out, timeout=600,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        assert "up to 3 trial(s) in flight, each on 2 machine(s)" in result.stderr
        trials = trials_of(url)
        status, body = dashboard_get(url, "/api/studies")  # what optuna-dashboard serves
        assert status.startswith("200") and b'"study_name": "tiny"' in body.replace(b'":"', b'": "')
    failed = [t.user_attrs.get("reason") for t in trials if t.state == TrialState.FAIL]
    assert not failed, failed
    search = [t for t in trials if t.user_attrs.get("role") == "search"]
    assert len(search) == 3 and all(t.state == TrialState.COMPLETE for t in search)
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    assert most_at_once(search) == 3  # in flight: one of them waiting for room
    # Each trial's run folder came back: node 0's summary of both ranks, node 1's folder.
    folders = sorted(p.name for p in (out / "trials").iterdir())
    assert folders == [f"{t.number:05d}" for t in sorted(search, key=lambda t: t.number)]
    for trial in search:
        run = Path(trial.user_attrs["folder"]) / "run"
        summary = json.loads((run / "summary.json").read_text())
        assert summary["world_size"] == 2
        assert summary["samples_per_s"] == pytest.approx(trial.user_attrs["throughput"])
        assert (run / "nodes" / "node1" / "stderr.txt").exists()
        assert summary["hardware"]["nodes"][0]["ray"] == "2.60.0"
        assert summary["hardware"]["nodes"][0]["node_type"] == "fake_cpu_node"
        assert trial.user_attrs["hardware"].startswith("1 machine (fake_cpu_node), 2 cores")
        # A trial's checkpoints stay on its machines: the summary named a folder here.
        checkpoint = summary["optimizations"]["checkpoint"]
        assert checkpoint["checkpoints"] == 2 and checkpoint["dir"] is None


def test_a_machine_lost_mid_trial_fails_that_trial_and_the_study_completes(
    cluster, tiny_scenario, tmp_path
):
    gate = tmp_path / "gate"
    gate.with_suffix(".first").touch()  # the trial waits at its step 2 until the gate opens
    optimizations = f"{{ddp_overlap: {{intensity: 1}}, toy_gate: {{path: '{gate}', step: 2}}}}"
    tune = TUNE[:-1] % (1, 4) + ", search: {ddp_overlap: null}}"
    path = two_machine_scenario(tiny_scenario, optimizations, tune)
    out = tmp_path / "tune"
    training = steps_on_new_machines(cluster)  # a trial's ranks measured steps there
    log = tmp_path / "tune.log"
    with log.open("wb") as sink:
        driver = subprocess.Popen(
            [sys.executable, "-m", "overlapkit", "tune", str(path), "--ray", cluster.address]
            + ["--max-concurrent", "1", "--out", str(out), "--json"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=sink,
        )
    try:
        wait_for(training, 240, "the first trial to train", log)
        victim = cluster.workers.pop()
        gone = victim.node_id
        cluster.cluster.remove_node(victim, allow_graceful=False)
        # What an autoscaler does: a new machine in its place, for the setting's retry.
        cluster.workers.append(cluster.cluster.add_node(**NODE))
        gate.with_suffix(".open").touch()  # the retry runs through
        stdout, _ = driver.communicate(timeout=600)
        assert driver.returncode == 0, log.read_text()[-3000:]
    finally:
        driver.kill()
        driver.wait()
    # Only the report on stdout: Ray printed the lost machine's state dump (~50 lines)
    # there; now its first line goes to stderr.
    assert json.loads(stdout)["trials"]["failed"] == 1, stdout[:3000]
    trials = trials_of(sqlite(out))
    lost = [t for t in trials if t.user_attrs.get("failure") == "node_lost"]
    assert len(lost) == 1 and lost[0].state == TrialState.FAIL, log.read_text()[-3000:]
    assert "was lost" in lost[0].user_attrs["reason"]
    retry = [t for t in trials if t.user_attrs.get("retry")]
    assert len(retry) == 1 and retry[0].params == lost[0].params
    assert retry[0].state == TrialState.COMPLETE
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert complete == retry  # the budget of one trial, filled by the retry
    assert "node_lost" in log.read_text()  # the trial line says why
    # Its placement group was freed: every CPU of the cluster is free again.
    import ray

    ray.init(address=cluster.address, log_to_driver=False)
    try:
        # The cluster counts the lost machine out (its health checks fail for seconds
        # after it died): until then the next test's trials could be placed on it.
        wait_for(
            lambda: not [n for n in ray.nodes() if n["NodeID"] == gone and n["Alive"]],
            120,
            "the cluster to count the lost machine out",
        )
        wait_for(
            lambda: ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"],
            60,
            "the trials' CPUs to be given back",
        )
    finally:
        ray.shutdown()


def test_a_driver_killed_and_started_again_resumes_the_study(cluster, tiny_scenario, tmp_path):
    # The first trial runs through; the second waits at its step 3 until the gate opens.
    gate = tmp_path / "gate"
    optimizations = f"{{ddp_overlap: {{intensity: 1}}, toy_gate: {{path: '{gate}', step: 3}}}}"
    tune = TUNE[:-1] % (2, 6) + ", search: {ddp_overlap: null}}"
    path = two_machine_scenario(tiny_scenario, optimizations, tune)
    out = tmp_path / "tune"
    command = ["tune", str(path), "--ray", cluster.address, "--max-concurrent", "1"]
    command += ["--out", str(out)]
    log = tmp_path / "tune.log"
    driver = start_driver(command, log)
    try:

        def one_done_one_running():
            try:
                trials = trials_of(sqlite(out))
            except (KeyError, sqlalchemy.exc.SQLAlchemyError):
                return False  # the study is not there yet
            failed = [t.user_attrs for t in trials if t.state == TrialState.FAIL]
            if failed:  # the gate was passed once: a trial run again would wait at it
                pytest.fail(f"a trial failed: {failed}\n{log.read_text()[-3000:]}")
            states = [t.state for t in trials]
            running = [t for t in trials if t.state == TrialState.RUNNING and "pid" in t.user_attrs]
            return states.count(TrialState.COMPLETE) >= 1 and running

        wait_for(one_done_one_running, 240, "one trial done and the next one running", log)
        # `kill`: the driver ends at once, as without Ray (Ray's handlers printed a C++
        # dump and aborted it); the driver alone: Ray cleans up after it.
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=30) == -signal.SIGTERM, log.read_text()[-3000:]
        assert "SIGTERM received" not in log.read_text()
    finally:
        driver.kill()
        driver.wait()
    gate.with_suffix(".open").touch()
    done_before = {t.number for t in trials_of(sqlite(out)) if t.state == TrialState.COMPLETE}
    result = run_cli(*command, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "were interrupted: marked failed and queued again" in result.stderr
    trials = trials_of(sqlite(out))
    interrupted = [t for t in trials if t.user_attrs.get("failure") == "interrupted"]
    assert len(interrupted) == 1 and interrupted[0].number not in done_before
    complete = {t.number for t in trials if t.state == TrialState.COMPLETE}
    assert complete >= done_before and len(complete) == 2
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]


def test_ctrl_c_stops_a_tune_on_ray_at_once_and_its_trial_runs_again(
    cluster, tiny_scenario, tmp_path
):
    """Ctrl-C reaches the driver's main thread only: the threads waiting on the trials'
    machines are told to stop (untold, tune waited for them: here forever, a trial
    held at a gate). Their settings are queued again and the cluster freed."""
    gate = tmp_path / "gate"
    gate.with_suffix(".first").touch()  # every run waits at the gate, never opened
    optimizations = f"{{ddp_overlap: {{intensity: 1}}, toy_gate: {{path: '{gate}', step: 1}}}}"
    tune = TUNE[:-1] % (1, 4) + ", search: {ddp_overlap: null}}"
    path = two_machine_scenario(tiny_scenario, optimizations, tune)
    out = tmp_path / "tune"
    at_the_gate = steps_on_new_machines(cluster)  # step 0 measured: rank 0 waits at step 1
    log = tmp_path / "tune.log"
    command = ["tune", str(path), "--ray", cluster.address, "--out", str(out)]
    driver = start_driver(command, log, session=True)  # Ctrl-C reaches its whole group
    try:
        wait_for(at_the_gate, 240, "a trial at the gate", log)
        os.killpg(driver.pid, signal.SIGINT)
        assert driver.wait(timeout=60) == 130, log.read_text()[-3000:]
    finally:
        driver.kill()
        driver.wait()
    said = log.read_text()
    assert "tune stopped" in said and "Traceback" not in said, said[-3000:]
    trials = trials_of(sqlite(out))
    stopped = [t for t in trials if t.user_attrs.get("failure") == "interrupted"]
    assert len(stopped) == 1 and stopped[0].state == TrialState.FAIL
    waiting = [t.system_attrs.get("fixed_params") for t in trials if t.state == TrialState.WAITING]
    assert waiting == [stopped[0].params]  # queued again
    import ray

    ray.init(address=cluster.address, log_to_driver=False)
    try:
        wait_for(
            lambda: ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"],
            60,
            "the stopped trial's CPUs to be given back",
        )
    finally:
        ray.shutdown()


# ------------------------------------------------------------------- one run
def test_a_run_on_two_machines_matches_two_local_ranks_and_resumes(
    cluster, tiny_scenario, tmp_path
):
    path = two_machine_scenario(
        tiny_scenario, "{ddp_overlap: {intensity: 0.5}, checkpoint: {every: 3}}"
    )
    on_ray = tmp_path / "ray"
    result = run_cli("run", path, "--ray", cluster.address, "--out", on_ray, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["world_size"] == 2 and summary["steps"] == 6
    # Every machine's folder is here: node 0's run folder, node 1's beside it.
    assert (on_ray / "summary.json").exists() and (on_ray / "steps.jsonl").exists()
    assert sorted(p.name for p in (on_ray / "nodes").iterdir()) == ["node1"]
    # Each machine kept its own checkpoints (no shared file system between them).
    for folder in (on_ray, on_ray / "nodes" / "node1"):
        assert list((folder / "checkpoints").glob("*")), folder
    assert summary["run_dir"] == str(on_ray)  # not the machine's temporary folder
    assert summary["optimizations"]["checkpoint"]["dir"] == str(on_ray / "checkpoints")
    # Nothing left on the machines: this run's folders went with it, and those that
    # earlier tests' killed drivers and lost machine left went with the next run there.
    assert not list(cluster.scratch.glob("overlapkit-node-*"))
    first = step_losses(on_ray)
    # Three more steps: each machine gets its checkpoints back and resumes.
    more = ["--set", "train.steps=9"]
    result = run_cli("run", path, "--ray", cluster.address, "--out", on_ray, "--json", *more)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from the checkpoints" in result.stderr
    for folder in (on_ray, on_ray / "nodes" / "node1"):  # keep: 2, here as there
        held = sorted(p.name for p in (folder / "checkpoints").iterdir())
        listed = (folder / "checkpoints" / "manifest.json").read_text()
        steps = [c["step"] for c in json.loads(listed)["checkpoints"]]
        assert len([h for h in held if h.startswith("step-")]) == 2, (held, steps)
    resumed = step_losses(on_ray)
    last = max(step for step, _ in first)
    assert max(step for step, _ in resumed) == last + 3
    # Two local ranks, 9 steps straight: their first steps are the first run's, their
    # last 3 the resumed run's (the learning rate is constant), every rank's loss.
    straight = tmp_path / "straight"
    two = ["--set", "world.nodes=1", "--set", "world.nprocs=2"]
    assert run_cli("run", path, "--out", straight, "--quiet", *two, *more).returncode == 0
    local = step_losses(straight)
    for ran in (first, resumed):
        assert set(ran) == {(step, rank) for step, _ in ran for rank in (0, 1)}, sorted(ran)
        for key, loss in ran.items():
            assert loss == pytest.approx(local[key], rel=1e-6), key

    def mean_loss(step: int) -> float:
        return (local[(step, 0)] + local[(step, 1)]) / 2

    assert summary["final_loss"] == pytest.approx(mean_loss(last), rel=1e-6)
    assert json.loads(result.stdout)["final_loss"] == pytest.approx(mean_loss(last + 3), rel=1e-6)


def test_a_run_whose_driver_is_killed_resumes_from_the_checkpoints_that_reached_it(
    cluster, tiny_scenario, tmp_path
):
    """Each machine's checkpoints are mirrored to the driver as they are written: a
    driver killed mid-run (or a machine lost, or Ctrl-C) leaves them in the run folder,
    and the same command resumes (they came back only with a run that ended well)."""
    gate = tmp_path / "gate"
    Path(f"{gate}.first").touch()  # the run waits at step 5 until the gate opens
    optimizations = f"{{checkpoint: {{every: 2}}, toy_gate: {{path: '{gate}', step: 5}}}}"
    path = two_machine_scenario(tiny_scenario, optimizations)
    out = tmp_path / "run"
    command = ["run", str(path), "--ray", cluster.address, "--out", str(out)]
    log = tmp_path / "run.log"
    driver = start_driver(command, log)
    mirrors = [out / "checkpoints", out / "nodes" / "node1" / "checkpoints"]

    def step_4_here():
        texts = [m / "manifest.json" for m in mirrors]
        return all(t.exists() and '"step": 4' in t.read_text() for t in texts)

    try:
        wait_for(step_4_here, 240, "step 4's checkpoint to reach the driver", log)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    Path(f"{gate}.open").touch()
    result = run_cli(*command, "--json", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from the checkpoints" in result.stderr
    summary = json.loads(result.stdout)
    assert summary["optimizations"]["checkpoint"]["resumed_from_step"] == 4
    # Steps 4-7, the first the resumed process's warm-up: 3 measured.
    assert summary["steps"] == 3 and summary["run_dir"] == str(out)


def test_paths_and_plugins_are_the_drivers_and_data_a_machine_lacks_is_one_line(
    cluster, tiny_scenario, tmp_path, monkeypatch
):
    """A relative data.root and --tensorboard name the driver's folders (the ranks ran
    in the Ray worker's folder: the data was not found there and the event files were
    written there, the run said ok), and the driver's OVERLAPKIT_PLUGINS is each
    machine's (a plugin's optimization was unknown there). Data that the driver has and
    a machine lacks (here ~, the driver's home not the machine's) is the machine's one
    line, exit status 2 (it was status 1 and "exit codes per machine [2]")."""
    from test_cli_errors import image_folder

    home = tmp_path / "home"
    image_folder(home / "images", classes="ab")
    text = TINY_SCENARIO.replace("num_classes: 4, width", "num_classes: 2, width")
    text = text.replace("steps: 6", "steps: 1").replace("warmup_steps: 2", "warmup_steps: 0")
    data = "data: {name: imagefolder, root: %s, size: 16}"
    text = "\n".join(data if line.startswith("data:") else line for line in text.splitlines())
    path = tiny_scenario(text % "images" + "\noptimizations: {toy_elsewhere: {}}\n")
    run = ["run", path, "--ray", cluster.address, "--quiet", "--set", "world.device=cpu"]
    monkeypatch.setenv("OVERLAPKIT_PLUGINS", "toy_plugins,toy_elsewhere")
    result = run_cli(*run, "--out", tmp_path / "r1", "--tensorboard", "board", cwd=home)
    assert result.returncode == 0, result.stderr[-3000:]
    assert list((home / "board").glob("events.out.tfevents.*")), "no TensorBoard files here"
    summary = json.loads((tmp_path / "r1" / "summary.json").read_text())
    assert "toy_elsewhere" in summary["optimizations"]
    monkeypatch.setenv("HOME", str(home))
    result = run_cli(*run, "--out", tmp_path / "r2", "--set", "data.root=~/images")
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith("error: machine 0 of the run (") and "image folder not found" in line


def test_a_run_stopped_with_sigterm_says_where_as_ctrl_c_does(cluster, tiny_scenario, tmp_path):
    """`kill` (SIGTERM) of the driver: one line naming the newest checkpoint that
    reached it, status 143, as on one machine (Ray's handler printed a C++ dump and
    exited with status 15, no word of the run)."""
    gate = tmp_path / "gate"
    Path(f"{gate}.first").touch()  # the run waits at step 5
    text = TINY_SCENARIO.replace("world: {nprocs: 1}", "world: {nprocs: 1, device: cpu}")
    text += f"optimizations: {{checkpoint: {{every: 2}}, toy_gate: {{path: '{gate}', step: 5}}}}\n"
    out = tmp_path / "run"
    command = ["run", str(tiny_scenario(text)), "--ray", cluster.address, "--out", str(out)]
    driver = subprocess.Popen(
        [sys.executable, "-m", "overlapkit", *command, "--quiet"],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    manifest = out / "checkpoints" / "manifest.json"
    try:
        wait_for(lambda: manifest.exists() and '"step": 4' in manifest.read_text(), 120, "step 4")
        driver.send_signal(signal.SIGTERM)
        _, err = driver.communicate(timeout=60)
    finally:
        driver.kill()
        driver.wait()
    assert driver.returncode == 143, err[-3000:]
    assert "overlapkit: stopped by SIGTERM" in err and "the newest checkpoint is step 4" in err
    assert "SIGTERM received" not in err, err[-3000:]


def test_checkpoints_this_machine_cannot_take_are_kept_on_the_machines_and_resume(
    cluster, tiny_scenario, tmp_path
):
    """This machine's disk full (here: a file where the machines' checkpoints are
    mirrored): each machine removed its folder, the checkpoints that had not reached
    this machine with it, and the run ended in the bare OSError. Now each machine keeps
    its folder, the error says where, and the run resumes from what it holds."""
    text = TINY_SCENARIO.replace("world: {nprocs: 1}", "world: {nprocs: 1, device: cpu}")
    path = tiny_scenario(text + "optimizations: {checkpoint: {every: 2}}\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("in the way")
    command = ["run", path, "--ray", cluster.address, "--out", out]
    result = run_cli(*command, "--quiet")
    assert result.returncode == 1, result.stderr[-3000:]
    (kept,) = cluster.scratch.glob("overlapkit-kept-*")
    assert "run failed on the cluster: this machine could not take" in result.stderr
    assert "machine 0 (" in result.stderr and f"at {kept};" in result.stderr, result.stderr
    listed = json.loads((kept / "run" / "checkpoints" / "manifest.json").read_text())
    newest = max(c["step"] for c in listed["checkpoints"])
    # As the error says: its run/ copied into the run folder, the same command resumes.
    (out / "checkpoints").unlink()
    shutil.copytree(kept / "run", out, dirs_exist_ok=True)
    shutil.rmtree(kept)
    result = run_cli(*command, "--json", "--set", "train.steps=9")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["optimizations"]["checkpoint"]["resumed_from_step"] == newest


def test_a_trial_waiting_for_room_past_tunes_timeout_is_queued_for_the_next_tune(
    cluster, tiny_scenario, tmp_path
):
    """Two trials in flight on a cluster that holds one: the second waited for room
    for as long as the first ran, past tune's --timeout, and then ran whole."""
    gate = tmp_path / "gate"
    Path(f"{gate}.first").touch()  # every trial waits at step 2 until the gate opens
    optimizations = f"{{toy_gate: {{path: '{gate}', step: 2}}}}"
    path = two_machine_scenario(tiny_scenario, optimizations, TUNE % (2, 4))
    out = tmp_path / "tune"
    command = ["tune", str(path), "--ray", cluster.address, "--max-concurrent", "2"]
    command += ["--out", str(out), "--timeout", "3", "--set", "world.threads=2"]
    log = tmp_path / "tune.log"
    driver = start_driver(command, log)
    try:

        def given_up():
            try:
                return [t for t in trials_of(sqlite(out)) if t.state == TrialState.FAIL]
            except (KeyError, sqlalchemy.exc.SQLAlchemyError):
                return []  # the study is not there yet

        (waited,) = wait_for(given_up, 120, "the waiting trial to give up", log)
        gate.with_suffix(".open").touch()
        assert driver.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        driver.kill()
        driver.wait()
    assert waited.user_attrs["failure"] == "no_room"
    assert "tune's --timeout" in waited.user_attrs["reason"]
    trials = trials_of(sqlite(out))
    (ran,) = [t for t in trials if t.state == TrialState.COMPLETE]
    (again,) = [t for t in trials if t.state == TrialState.WAITING]
    assert again.system_attrs["fixed_params"] == waited.params  # runs first next time
    assert ran.number != waited.number
    # The report tells it from a failed setting.
    report = json.loads((out / "report.json").read_text())["trials"]
    assert report["failed"] == 1 and report["queued_again"] == 1
    assert "1 failed (1 of them stopped before their end" in (out / "report.md").read_text()


def test_a_trial_the_cluster_has_no_room_for_waits_says_so_and_runs_again_later(
    cluster, tiny_scenario, tmp_path
):
    """Three machines asked of a cluster of two: the tune says none fits now, the run
    says it waits for room, and when it gives up the trial is not the setting's
    failure: it is queued again (it was failed for good, with no reason)."""
    path = two_machine_scenario(tiny_scenario, "{ddp_overlap: {intensity: 1}}", TUNE % (1, 4))
    out = tmp_path / "tune"
    env = {**os.environ, "OVERLAPKIT_RAY_ROOM_TIMEOUT_S": "4"}  # said at 2 s
    env["http_proxy"] = "http://127.0.0.1:9"  # Ray connects without it: so must the check
    command = ["tune", str(path), "--ray", cluster.address, "--out", str(out)]
    result = subprocess.run(
        [sys.executable, "-m", "overlapkit", *command, "--set", "world.nodes=3"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "none fits on its live machines now" in result.stdout + result.stderr
    assert "waiting for room on the cluster for 3 machine(s)" in result.stderr
    assert "found no room within 4 s" in result.stderr
    trials = trials_of(sqlite(out))
    (tried,) = [t for t in trials if t.state == TrialState.FAIL]
    assert tried.user_attrs["failure"] == "no_room" and "no room" in tried.user_attrs["reason"]
    (again,) = [t for t in trials if t.state == TrialState.WAITING]
    assert again.system_attrs["fixed_params"] == tried.params  # queued: not run yet


def test_a_tensorflow_run_on_two_machines_equals_two_local_ranks(cluster, tiny_scenario, tmp_path):
    """MultiWorkerMirroredStrategy across two Ray machines: each machine's rank finds
    its TensorFlow server's address and port, and the result is bit for bit the one
    of two ranks on one machine."""
    pytest.importorskip("tensorflow")
    text = TINY_SCENARIO.replace("name: tiny", "name: tiny\nframework: tensorflow")
    text = text.replace("world: {nprocs: 1}", "world: {nprocs: 1, nodes: 2, device: cpu}")
    text = text.replace("  seed: 0", "  seed: 0\n  deterministic: true")
    path = tiny_scenario(text + "optimizations: {ddp_overlap: {intensity: 0.5}}\n")
    result = run_cli("run", path, "--ray", cluster.address, "--out", tmp_path / "ray", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["world_size"] == 2 and summary["strategy"]["replicas"] == 2
    assert summary["strategy"]["replicas_identical"]
    local = tmp_path / "local"
    two = ["--set", "world.nodes=1", "--set", "world.nprocs=2"]
    assert run_cli("run", path, "--out", local, "--quiet", *two).returncode == 0
    local_summary = json.loads((local / "summary.json").read_text())
    assert summary["strategy"]["model_sha256"] == local_summary["strategy"]["model_sha256"]


def test_no_cluster_at_the_address_is_a_clear_error_at_once(tiny_scenario, monkeypatch):
    from conftest import free_port

    path = two_machine_scenario(tiny_scenario, "{}")
    result = run_cli("run", path, "--ray", f"127.0.0.1:{free_port()}", timeout=60)
    assert result.returncode == 2
    assert "no Ray cluster answers at 127.0.0.1:" in result.stderr
    assert "Traceback" not in result.stderr
    # A stale RAY_ADDRESS (a cluster gone since) behind a plain --ray: the same line, not
    # minutes of Ray's retries.
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{free_port()}")
    result = run_cli("run", path, "--ray", timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "no Ray cluster answers at 127.0.0.1:" in result.stderr
    assert "(from RAY_ADDRESS)" in result.stderr
    monkeypatch.delenv("RAY_ADDRESS")
    # The dashboard's URL (what `ray job submit` takes): not "Name or service not known".
    result = cli_here("run", path, "--ray", "http://127.0.0.1:8265")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "not the URL 'http://127.0.0.1:8265'" in result.stderr, result.stderr
    # Something else listening there (a web server): said at once, not retried for minutes
    # (after GRPC_READY_S, 10 s: 1 s here).
    import http.server
    import threading

    from overlapkit.launch import ray_nodes

    monkeypatch.setattr(ray_nodes, "GRPC_READY_S", 1.0)
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        result = cli_here("run", path, "--ray", address)
    finally:
        server.shutdown()
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{address} answers, but not as a Ray cluster" in result.stderr


def test_the_actor_on_each_machine_imports_no_torch():
    """What a run's Ray actor imports (its class, the live step log's reader, the node
    type's name) leaves torch out: importing it took each actor ~1.5 s of a 2-core
    machine before the machine's ranks could start."""
    code = (
        "import sys, overlapkit.launch.ray_nodes, overlapkit.runtime.report, "
        "overlapkit.runtime.hardware; print(sorted(m for m in sys.modules if m == 'torch'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_tune_trials_relative_data_root_is_made_absolute_in_the_text_sent_only(
    tmp_path, monkeypatch
):
    """tune --ray makes a relative data.root absolute in each trial's text for the
    machines, not in the study's scenario: a study begun without --ray (or from another
    folder on a shared database) was refused as "measured with another scenario"."""
    from overlapkit.launch.ray_paths import data_root_from_here

    monkeypatch.chdir(tmp_path)
    scenario = {"name": "s", "data": {"name": "imagefolder", "root": "images"}}
    sent = data_root_from_here(scenario)
    assert sent["data"]["root"] == str(tmp_path / "images")
    assert scenario["data"]["root"] == "images"  # the study's own, as written
    for kept in ("~/images", "/abs/images"):
        assert data_root_from_here({"data": {"root": kept}})["data"]["root"] == kept


def test_a_machines_own_plugins_stay_beside_the_drivers():
    from overlapkit.launch.ray_nodes import joined_plugins

    # The driver's list replaced the machine's: a plugin its ranks import was dropped.
    assert joined_plugins("toy_plugins, toy_elsewhere", "site_hooks,toy_plugins") == (
        "toy_plugins,toy_elsewhere,site_hooks"
    )
    assert joined_plugins("toy_plugins", None) == "toy_plugins"


def test_a_machines_run_folder_goes_with_its_run_and_an_orphaned_one_with_the_next(
    tmp_path, monkeypatch
):
    """Each run left its folder (its checkpoints: gigabytes on a real model) in each
    machine's temporary folder when it was stopped, failed or lost its driver."""
    import tempfile

    from overlapkit.launch.ray_nodes import NodeRunner

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # an actor killed with its driver, before any stop
    host = socket.gethostname()
    orphan = tmp_path / f"overlapkit-node-{host}-{gone.pid}-x1"
    live = tmp_path / f"overlapkit-node-{host}-{os.getpid()}-x2"  # another run's, going on
    # Another machine's, in a temporary folder the machines share: its pid is not ours.
    elsewhere = tmp_path / f"overlapkit-node-{host}x-{gone.pid}-x3"
    for folder in (orphan, live, elsewhere):
        (folder / "run" / "checkpoints").mkdir(parents=True)
    runner = NodeRunner()
    assert not orphan.exists() and live.exists() and elsewhere.exists()
    assert runner.folder.is_dir()
    # A run stopped (Ctrl-C, a failed peer): its ranks killed and its folder removed.
    runner.process = subprocess.Popen(["sleep", "60"], start_new_session=True)
    (runner.folder / "run" / "checkpoints").mkdir(parents=True)
    runner.stop()
    assert runner.process.returncode == -signal.SIGKILL and not runner.folder.exists()


def test_a_machines_refusal_is_its_whole_error_not_its_last_three_lines():
    from overlapkit.launch.ray_run import _refusal

    said = "warning: something else\nerror: data.root: no such folder\n  /data/images\n"
    assert _refusal(said) == "data.root: no such folder /data/images"
    assert _refusal("a\nb\nc\nd\n") == "b c d"  # no error line: the last lines


def test_a_cluster_that_does_not_answer_while_a_run_waits_for_room_is_waited_out(monkeypatch):
    """The room check asked the cluster every second, and a question it did not answer
    (its GCS restarting) failed the run with Ray's error. A stand-in for the cluster
    here (no GCS to restart on this machine): questions fail, then say it is short."""
    import ray
    from ray.exceptions import RpcError

    from conftest import FakeClock
    from overlapkit.launch import ray_nodes
    from overlapkit.launch.config import WorldConfig

    clock = FakeClock()
    monkeypatch.setattr(ray_nodes.time, "monotonic", clock)
    monkeypatch.setattr(ray_nodes.time, "time", clock)
    answers = iter([RpcError("GCS restarting")] * 3 + [0] * 100)
    asked = []

    def runs_that_fit(world):
        asked.append(clock.now)
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def unplaced(refs, timeout):
        clock.sleep(timeout)
        return [], refs

    def nodes():
        raise RpcError("GCS restarting")

    monkeypatch.setattr(ray_nodes, "runs_that_fit", runs_that_fit)
    monkeypatch.setattr(ray, "wait", unplaced)
    monkeypatch.setattr(ray, "nodes", nodes)
    group = SimpleNamespace(ready=lambda: "placed")
    world = WorldConfig(nodes=2, nprocs=1, device="cpu", threads=1)
    with pytest.raises(ray_nodes.RayClusterError, match="no room within 5 s") as error:
        ray_nodes._wait_for_room(group, world, "STRICT_SPREAD", 5.0, None)
    assert "machines it did not name (it did not answer)" in str(error.value)
    assert [t - 1000 for t in asked[:4]] == [2, 4, 6, 8]  # every ROOM_CHECK_S
    # Short from the first answer on (at 8 s, counted from the check before it, 6 s):
    # given up at 12 s; the questions left unanswered before do not count.
    assert clock.now - 1000 == pytest.approx(12)
    # Tune's deadline while no answer has come: the trial gives up then.
    answers = iter([RpcError("GCS restarting")] * 100)
    with pytest.raises(ray_nodes.OutOfTime):
        ray_nodes._wait_for_room(group, world, "STRICT_SPREAD", 900.0, clock.now + 30)
