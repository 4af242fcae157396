"""log.tensorboard: event files written by real runs and a real study, read back with
TensorBoard's own reader (a study's trials, each a run of its own, are read back in
test_tune's tiny study)."""

from __future__ import annotations

import json

import pytest

from conftest import TINY_SCENARIO, run_cli

pytest.importorskip("tensorboard")


def scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_a_run_writes_loss_throughput_and_phases_per_step(tmp_path):
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(TINY_SCENARIO + "optimizations: {checkpoint: {every: 3}}\n")
    board = tmp_path / "board"
    result = run_cli("run", scenario, "--out", tmp_path / "run", "--quiet", "--tensorboard", board)
    assert result.returncode == 0, result.stderr[-2000:]
    # TensorBoard writes with its own file layer: a torch run does not start TensorFlow
    # (3.7 s per run where it is installed, and its start-up lines on stderr).
    assert "TensorFlow" not in result.stderr and "oneDNN" not in result.stderr
    steps = [
        json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()
    ]
    logged = scalars(board)
    # Every step of steps.jsonl (warm-up too), by its step number, with its loss.
    assert logged["train/loss"] == [(s["step"], pytest.approx(s["loss"], rel=1e-6)) for s in steps]
    assert [step for step, _ in logged["train/samples_per_s"]] == [s["step"] for s in steps]
    assert logged["phases_ms/ckpt_stall"] == [
        (s["step"], pytest.approx(s["phases_s"]["ckpt_stall"] * 1e3, rel=1e-5)) for s in steps
    ]
    assert {"phases_ms/forward", "phases_ms/backward", "train/step_time_ms"} <= set(logged)
