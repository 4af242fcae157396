"""The README's quickstart and benchmark commands keep working."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT, run_cli

pytestmark = pytest.mark.slow


def test_quickstart_scenario_runs_and_prints_the_summary(tmp_path):
    result = run_cli("run", "scenarios/quickstart.yaml", "--out", tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "quickstart: 60 measured steps" in result.stdout
    assert "where each step's time went" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 60
    assert summary["eval"]["accuracy"] > 0.3  # ten classes: chance is 0.1


def run_benchmark(script: str) -> tuple[str, dict]:
    """Run ``benchmarks/<script> --quick --json``; return its output and its JSON numbers."""
    result = subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, json.loads(result.stdout[result.stdout.index("{\n") :])


def test_runtime_overhead_benchmark_runs():
    output, numbers = run_benchmark("runtime_overhead.py")
    assert "runtime overhead" in output
    # the ratio says what over what, and a --quick table says it is not to be quoted
    assert "ratio = overlapkit / plain" in output and "--quick: a smoke test" in output
    assert all(r["ratio"] > 0 and r["plain_step_ms"] > 0 for r in numbers.values())


def test_ddp_overlap_benchmark_runs():
    _, numbers = run_benchmark("ddp_overlap.py")
    baseline = numbers["buckets"]["no overlap (baseline)"]
    assert baseline["ratio"] == 1.0 and baseline["hidden_fraction"] == 0.0
    assert numbers["buckets"]["4 MB buckets"]["buckets"] > 1


def test_gpu_benchmark_runs_every_part_on_a_cpu(tmp_path):
    # A lent GPU is rare: its benchmark must not first fail there on a stale path.
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/gpu.py",
            "--device",
            "cpu",
            "--quick",
            "--rounds",
            "1",
            "--json",
            tmp_path / "n.json",
            # a folder that does not exist yet: it was a FileNotFoundError traceback
            "--dir",
            tmp_path / "new" / "scratch",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "new" / "scratch").is_dir()
    numbers = json.loads((tmp_path / "n.json").read_text())
    for model in ("resnet18", "resnet50"):
        rows = numbers["a"][model]["rows"]
        assert len(rows) == 5 and all(row["ms_per_step"] > 0 for row in rows.values())
        # run_scenario against a plain loop over the same CPU loader, beside the rest
        assert rows["overlapkit run_scenario (CPU loader)"]["ratio_to_plain_loader"] > 0
        precision = numbers["d"][model]["rows"]
        assert precision["fp32"]["ms_per_step"] > 0 and precision["bf16"]["ms_per_step"] > 0
        assert precision["fp16"] == {"unavailable": "n/a on cpu"}  # labelled, not invented
    checkpoints = numbers["b"]["rows"]
    assert [name.split(" every")[0].split(" (")[0] for name in checkpoints] == [
        "none",
        "torch.save",
        "DCP async_save",
        "overlapkit",
        "overlapkit auto",
    ]
    for name, row in checkpoints.items():
        assert all(n > 0 for n in row["checkpoints"]) or name == "none", name
        if name.startswith("overlapkit"):
            assert row["checkpoint_section"]["stall_s_mean"] > 0, name
    prefetch = numbers["c"]["rows"]
    assert prefetch["intensity 1"]["settings"]["workers"] > 0
    assert prefetch["intensity 1"]["data_wait_share"] < prefetch["intensity 0"]["data_wait_share"]


def run_benchmark_args(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("runtime_overhead.py", ["--repeats", "0"], "--repeats: 0 is too small: at least 1"),
        (
            "checkpoint.py",
            ["--every", "0", "--steps", "2", "--repeats", "1"],
            "--every: 0 is too small: at least 1",
        ),
        ("ray_startup.py", ["--rounds", "x"], "--rounds: 'x' is not a whole number"),
        (
            "gpu.py",
            ["--device", "cpu", "--quick", "--parts", "a", "--rounds", "0"],
            "--rounds: 0 is too small: at least 1",
        ),
        # an unknown source ran as the CPU-burning one, labelled with the unknown name
        (
            "prefetch.py",
            ["--kinds", "disk", "--steps", "1", "--repeats", "1", "--backends", "torch"],
            "--kinds: unknown disk: choose from sleep, cpu",
        ),
        (
            "prefetch.py",
            ["--backends", "jax", "--steps", "1", "--repeats", "1"],
            "--backends: unknown jax: choose from",
        ),
    ],
)
def test_a_benchmarks_bad_flag_is_one_line_and_exit_2(script, args, message):
    """Every script takes its counts through benchmarks/_cli.py: a few stand for all."""
    result = run_benchmark_args(script, *args)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr and "Traceback" not in result.stderr


def test_a_benchmarks_help_gives_its_docstrings_whole_first_paragraph():
    # it was the docstring's first line only, cut mid-sentence
    result = run_benchmark_args("checkpoint.py", "--help")
    assert "checkpoint every k; and overlapkit in auto mode" in " ".join(result.stdout.split())


def test_ray_startups_local_rows_are_the_reference_not_a_measured_zero():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import ray_startup
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert ray_startup.more_than_local("local worker, 1 rank", 2.0, 2.0) == "— (reference)"
    assert ray_startup.more_than_local("Ray, 1 machine x 1 rank", 2.5, 2.0) == "+0.50 s (1.25x)"


def test_partitions_benchmark_removes_its_run_folders(monkeypatch):
    # each `overlapkit run` keeps its checkpoints: 3 rounds left hundreds of MB in /tmp
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import partition
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    folders = []

    def fake_run(scenario, sets, folder):
        folders.append(folder)
        folder.mkdir()
        (folder / "checkpoint").write_bytes(b"x")
        raise RuntimeError("stop after the first run")

    monkeypatch.setattr(partition, "run", fake_run)
    monkeypatch.setattr(sys, "argv", ["partition.py", "--rounds", "1"])
    with pytest.raises(RuntimeError, match="stop after the first run"):
        partition.main()
    assert len(folders) == 1 and not folders[0].parent.exists()
