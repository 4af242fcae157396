"""Multi-rank runs with real processes and real gloo process groups on localhost."""

import inspect
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ROOT, TINY_SCENARIO, cli_here, free_port, run_cli, running
from overlapkit.runtime.distributed import init_world

# How long a rank waits in a collective for a peer that is gone: the process group's timeout.
HANG_S = inspect.signature(init_world).parameters["timeout_s"].default


def read_steps(folder):
    return [json.loads(line) for line in (folder / "steps.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_rank_run_gathers_every_ranks_metrics(tiny_scenario, tmp_path):
    out = tmp_path / "out"
    result = run_cli(
        "run",
        tiny_scenario(),
        "--out",
        out,
        "--json",
        "--set",
        "world.nprocs=2",
        "--set",
        "optimizations.toy_probe.intensity=1",
        "--set",
        "train.eval.at_end=true",
        "--set",
        "data.eval_samples=63",
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 6
    assert [r["rank"] for r in summary["per_rank"]] == [0, 1]
    steps = read_steps(out)
    assert [(s["step"], s["rank"]) for s in steps] == [(i, r) for i in range(8) for r in (0, 1)]
    # Each rank trains on its own shard of the data...
    assert [s["loss"] for s in steps if s["rank"] == 0] != [
        s["loss"] for s in steps if s["rank"] == 1
    ]
    # ...and the gradient all-reduce keeps the replicas identical.
    probes = [json.loads((out / f"probe-rank{r}.json").read_text()) for r in (0, 1)]
    assert probes[0]["param_sum"] == pytest.approx(probes[1]["param_sum"], rel=1e-6)
    assert probes[0]["param_abs_sum"] == pytest.approx(probes[1]["param_abs_sum"], rel=1e-6)
    assert [p["threads"] for p in probes] == [max(1, (os.cpu_count() or 1) // 2)] * 2
    # Without an overlap optimization the whole all-reduce is exposed, and measured.
    assert summary["grad_sync"]["mode"] == "flat_allreduce"
    assert not any("DistributedDataParallel" in n for n in summary.get("notes", []))  # a script's
    assert all(s["phases_s"]["comm_exposed"] > 0 for s in steps)
    assert 0 < summary["pop"]["parallel_efficiency"] <= 1
    # The sharded evaluation covers each held-out sample exactly once.
    assert summary["eval"]["runs"][-1]["samples"] == 63


@pytest.mark.slow
def test_a_failing_rank_fails_the_run_promptly_with_its_error(tiny_scenario, tmp_path):
    out = tmp_path / "out"
    start = time.monotonic()
    result = run_cli(
        "run",
        tiny_scenario(),
        "--out",
        out,
        "--set",
        "world.nprocs=2",
        "--set",
        "train.steps=1000",
        "--set",
        "optimizations.toy_probe.intensity=1",
        "--set",
        "optimizations.toy_fail={rank: 1, step: 3}",
        timeout=0.75 * HANG_S,
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 1
    assert "run failed: rank 1" in result.stderr
    assert "RuntimeError: toy failure on rank 1 at step 3" in result.stderr
    # Start-up included (seconds, or tens of them on a loaded machine); left waiting in
    # its all-reduce, rank 0 would fail only after the process group's timeout.
    assert elapsed < HANG_S / 2, f"took {elapsed:.1f} s"
    # No rank is left behind.
    time.sleep(0.5)
    for rank in (0, 1):
        pid = int((out / f"pid-rank{rank}.txt").read_text())
        assert not running(pid)


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_named_not_its_peer(tiny_scenario, tmp_path):
    # A process of its own (not run_cli's fork): its resource tracker is the run's own.
    command = [sys.executable, "-m", "overlapkit", "run", str(tiny_scenario())]
    result = subprocess.run(
        [
            *command,
            "--out",
            str(tmp_path / "run"),
            "--set",
            "world.nprocs=2",
            "--set",
            "train.steps=1000",
            "--set",
            "optimizations.toy_fail={rank: 1, step: 3, how: sigkill}",
            "--set",
            "optimizations.prefetch={backend: torch, workers: 2}",  # the killed rank's queues
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT / "tests" / "plugins")},
    )
    assert result.returncode == 1
    assert "run failed: rank 1" in result.stderr
    assert "died with SIGKILL" in result.stderr
    # Nothing under the line: multiprocessing's resource tracker warned of the "leaked
    # semaphore objects" it cleaned up after the killed rank.
    assert result.stderr.strip().splitlines()[-1].startswith("run failed"), result.stderr


@pytest.mark.slow
def test_the_same_entry_point_runs_under_torchrun(tiny_scenario, tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "overlapkit",
            "run",
            str(tiny_scenario()),
            "--out",
            str(out),
            "--quiet",
            "--set",
            "optimizations.toy_probe.intensity=1",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2  # torchrun's environment wins over world.nprocs=1
    probes = [json.loads((out / f"probe-rank{r}.json").read_text()) for r in (0, 1)]
    assert probes[0]["param_sum"] == pytest.approx(probes[1]["param_sum"], rel=1e-6)


# ------------------------------------------------------- several machines, by hand
def final_loss(folder):
    return json.loads((folder / "summary.json").read_text())["final_loss"]


@pytest.fixture(scope="module")
def two_local_ranks(tmp_path_factory):
    """The final loss of the tiny scenario on two local ranks with these ``--set``
    overrides: run once for the module's tests that compare with it."""
    losses = {}

    def final_loss_of(*overrides: str) -> float:
        if overrides not in losses:
            folder = tmp_path_factory.mktemp("local")
            scenario = folder / "scenario.yaml"
            scenario.write_text(textwrap.dedent(TINY_SCENARIO))
            sets = [part for name in ("world.nprocs=2", *overrides) for part in ("--set", name)]
            result = run_cli("run", scenario, "--out", folder / "run", "--quiet", *sets)
            assert result.returncode == 0, result.stderr
            losses[overrides] = final_loss(folder / "run")
        return losses[overrides]

    return final_loss_of


@pytest.mark.slow
@pytest.mark.parametrize("shared", [False, True], ids=["own folders", "one shared folder"])
def test_two_machines_started_by_hand_train_as_two_local_ranks(
    tiny_scenario, tmp_path, shared, two_local_ranks
):
    """What each Ray actor does, without Ray: node k of 2, rendezvous at node 0. With
    one folder (a shared file system), node 1 was refused: 'in use by another run',
    node 0's lock on the run folder, while node 0 waited for it."""
    from conftest import free_port

    master = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "overlapkit", "run", str(tiny_scenario()), "--quiet"]
    command += ["--set", "world.nodes=2", "--set", "optimizations.ddp_overlap.intensity=0.5"]
    nodes = [
        subprocess.Popen(
            [*command, "--out", str(tmp_path / ("node0" if shared else f"node{k}"))]
            + ["--node-rank", str(k)]
            + ["--master", master],
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in (0, 1)
    ]
    errors = [node.communicate(timeout=240)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], errors
    summary = json.loads((tmp_path / "node0" / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert not (tmp_path / "node1" / "summary.json").exists()  # rank 0 writes it
    local = two_local_ranks("optimizations.ddp_overlap.intensity=0.5")
    assert summary["final_loss"] == pytest.approx(local, rel=1e-6)


@pytest.mark.slow
def test_a_run_trains_in_a_process_group_started_before_it_and_leaves_it(
    tiny_scenario, tmp_path, two_local_ranks
):
    """Ray Train's TorchTrainer starts the group before the training function runs."""
    from rank_programs import run_in_a_group_started_before

    from overlapkit.launch.local import launch_local

    path = tiny_scenario()
    results = launch_local(run_in_a_group_started_before, 2, str(path), str(tmp_path / "adopted"))
    assert all(r["group_kept"] for r in results.values())
    assert results[0]["final_loss"] == pytest.approx(two_local_ranks(), rel=1e-6)
    assert final_loss(tmp_path / "adopted") == results[0]["final_loss"]


def test_a_scripts_gloo_group_on_a_gpu_is_adopted_with_backend_auto(monkeypatch):
    """pytorch/examples' imagenet script on one GPU starts its group on gloo (its own
    warning says nccl wants more than one GPU). A Session (backend auto: it has no
    backend argument) refused it: 'the scenario asks for nccl: set world.backend to
    gloo (or auto)', though there is no scenario and auto was what it had. The GPU is
    stood in for here (this test runs without one); a backend named in a scenario is
    still held to."""
    import torch
    import torch.distributed as dist

    from overlapkit.runtime import distributed
    from overlapkit.runtime.gpus import GPUSetupError

    monkeypatch.setattr(distributed, "pick_device", lambda device, rank: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    threads = torch.get_num_threads()  # init_world sets them
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        world = init_world("auto")
        assert (world.backend, world.adopted, world.device.type) == ("gloo", True, "cuda")
        with pytest.raises(GPUSetupError, match="set world.backend to gloo"):
            init_world("auto", backend="nccl")
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def test_several_machines_need_a_cluster_or_a_place_each(tiny_scenario, tmp_path):
    path = tiny_scenario()
    result = cli_here("run", path, "--set", "world.nodes=2", "--out", tmp_path / "a")
    assert result.returncode == 2
    assert "world.nodes: 2 asks for 2 machines" in result.stderr and "--ray" in result.stderr
    result = cli_here("run", path, "--set", "world.nodes=2", "--node-rank", "0")
    assert result.returncode == 2 and "--node-rank and --master go together" in result.stderr
    bad = cli_here("run", path, "--set", "world.nodes=2", "--node-rank", "2", "--master", "h:1")
    assert bad.returncode == 2 and "--node-rank must be in 0..1" in bad.stderr
    # Both ways at once: --node-rank and --master were ignored under --ray.
    place = ["--node-rank", "1", "--master", "1.2.3.4:5"]
    both = cli_here("run", path, "--set", "world.nodes=2", "--ray", "127.0.0.1:9", *place)
    assert both.returncode == 2 and "--node-rank and --master are for starting" in both.stderr
    assert len(both.stderr.strip().splitlines()) == 1, both.stderr
    result = cli_here("tune", path, "--set", "world.nodes=2", "--out", tmp_path / "t")
    assert result.returncode == 2 and "need --ray" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_resuming_a_run_folder_with_another_rank_count_is_a_clear_error(tiny_scenario, tmp_path):
    """Seen in a benchmark: the same --out, 1 rank then 2, ended in "internal error"."""
    out = tmp_path / "out"
    first = cli_here(
        "run", tiny_scenario(), "--out", out, "--quiet",
        "--set", "optimizations.checkpoint.every=4",
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    again = run_cli(
        "run", tiny_scenario(), "--out", out, "--quiet",
        "--set", "optimizations.checkpoint.every=4", "--set", "world.nprocs=2",
        "--set", "train.steps=10",  # more steps: a finished run has nothing to resume
    )  # fmt: skip
    # Refused before any rank starts: the user's mistake (it exited 1, "run failed", its
    # hint without the --out given, "1 ranks").
    assert again.returncode == 2, again.stderr
    assert "internal error" not in again.stderr and "Traceback" not in again.stderr
    assert "written by 1 rank; this run has 2" in again.stderr
    assert f"overlapkit run --out {out} --fresh" in again.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == kept


@pytest.mark.slow
def test_torchrun_without_a_run_id_refuses_to_resume_another_setup(tiny_scenario, tmp_path):
    """Without --standalone or --rdzv-id, every torchrun launch on one port names the
    same folder (runs/<name>-port<PORT>): a second launch with another seed resumed
    the first one's checkpoints silently (the refusals ran only for --out). Each rank
    printed the summary (with --json: two documents, not one)."""
    port = str(free_port())
    scenario = tiny_scenario()

    def torchrun(*settings):
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--node-rank", "0"]
            + ["--master-addr", "127.0.0.1", "--master-port", port, "--nproc-per-node", "2"]
            + ["-m", "overlapkit", "run", str(scenario), "--json"]
            + ["--set", "optimizations.checkpoint={every: 1}", *settings],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=tmp_path,
        )

    first = torchrun()
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads(first.stdout)["world_size"] == 2
    assert (tmp_path / "runs" / f"tiny-port{port}" / "checkpoints").is_dir()
    second = torchrun("--set", "train.seed=1", "--set", "train.steps=8")
    assert second.returncode != 0
    assert "holds checkpoints of another setup" in second.stderr, second.stderr[-3000:]
    assert "train.seed" in second.stderr
