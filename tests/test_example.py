"""The custom-loop example runs as a user would run it."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT

EXAMPLE = ROOT / "examples" / "custom_loop.py"


def run(*args, torchrun=False):
    prefix = [sys.executable]
    if torchrun:
        prefix += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    result = subprocess.run(
        [*prefix, str(EXAMPLE), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_custom_loop_trains_saves_and_resumes(tmp_path):
    first = run("--steps", "40", "--out", tmp_path)
    assert first["step"] == 40 and first["accuracy"] > 0.8  # four classes: chance is 0.25
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["name"] == "waveforms" and summary["steps"] == 37  # 3 warm-up steps
    assert (tmp_path / "checkpoints" / "step-00000040" / "rank00000.ckpt").is_file()
    resumed = run("--steps", "50", "--out", tmp_path, "--resume")
    assert resumed["step"] == 50
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(50))  # the first run's steps kept


@pytest.mark.slow
def test_custom_loop_under_torchrun(tmp_path):
    result = run("--steps", "20", "--out", tmp_path, torchrun=True)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and result["step"] == 20
    assert summary["eval"]["runs"][0]["samples"] == 512
