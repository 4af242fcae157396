"""Multi-rank runs with real processes and real gloo process groups on localhost."""

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT, run_cli

pytestmark = pytest.mark.slow


def read_steps(folder):
    return [json.loads(line) for line in (folder / "steps.jsonl").read_text().splitlines()]


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
    assert all(s["phases_s"]["comm_exposed"] > 0 for s in steps)
    assert 0 < summary["pop"]["parallel_efficiency"] <= 1
    # The sharded evaluation covers each held-out sample exactly once.
    assert summary["eval"]["runs"][-1]["samples"] == 63


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
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 1
    assert "run failed: rank 1" in result.stderr
    assert "RuntimeError: toy failure on rank 1 at step 3" in result.stderr
    assert elapsed < 45, f"took {elapsed:.1f} s"  # start-up included; the hang would be 300 s
    # No rank is left behind.
    time.sleep(0.5)
    for rank in (0, 1):
        pid = int((out / f"pid-rank{rank}.txt").read_text())
        assert (
            not os.path.exists(f"/proc/{pid}")
            or "zombie" in open(f"/proc/{pid}/status").read().lower()
        )


def test_a_rank_killed_by_a_signal_is_named_not_its_peer(tiny_scenario, tmp_path):
    result = run_cli(
        "run",
        tiny_scenario(),
        "--out",
        tmp_path,
        "--set",
        "world.nprocs=2",
        "--set",
        "train.steps=1000",
        "--set",
        "optimizations.toy_fail={rank: 1, step: 3, how: sigkill}",
        timeout=120,
    )
    assert result.returncode == 1
    assert "run failed: rank 1" in result.stderr
    assert "died with SIGKILL" in result.stderr


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
