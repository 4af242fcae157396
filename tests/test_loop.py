"""The built-in loop on one rank, in this process: determinism, metrics, run folder."""

import json

import pytest
import torch

from overlapkit.run import run_scenario
from overlapkit.runtime import PHASES
from overlapkit.scenarios import load_scenario


def run(tiny_scenario, tmp_path, *overrides, name="run"):
    scenario = load_scenario(tiny_scenario(), list(overrides))
    summary = run_scenario(scenario, tmp_path / name, progress=False, print_summary=False)
    steps = [
        json.loads(line) for line in (tmp_path / name / "steps.jsonl").read_text().splitlines()
    ]
    return summary, steps


def test_same_seed_same_losses_and_another_seed_differs(tiny_scenario, tmp_path):
    _, first = run(tiny_scenario, tmp_path, name="a")
    _, second = run(tiny_scenario, tmp_path, name="b")
    _, other = run(tiny_scenario, tmp_path, "train.seed=1", name="c")
    losses = [s["loss"] for s in first]
    assert len(losses) == 8
    assert losses == [s["loss"] for s in second]
    assert losses != [s["loss"] for s in other]


def test_run_folder_follows_the_public_contract(tiny_scenario, tmp_path):
    summary, steps = run(tiny_scenario, tmp_path, "train.eval.at_end=true")
    folder = tmp_path / "run"
    assert {p.name for p in folder.iterdir()} >= {"scenario.yaml", "steps.jsonl", "summary.json"}
    assert json.loads((folder / "summary.json").read_text()) == json.loads(json.dumps(summary))
    for key in (
        "name",
        "world_size",
        "steps",
        "samples_per_s",
        "step_time_s",
        "phases_s",
        "pop",
        "optimizations",
    ):
        assert key in summary
    assert summary["name"] == "tiny" and summary["world_size"] == 1 and summary["steps"] == 6
    assert set(summary["step_time_s"]) >= {"mean", "p50", "p90"}
    assert set(summary["phases_s"]) == set(PHASES)
    assert set(summary["pop"]) == {
        "load_balance",
        "communication_efficiency",
        "parallel_efficiency",
    }
    assert [s["step"] for s in steps] == list(range(8))
    assert [s["warmup"] for s in steps] == [True, True] + [False] * 6
    for record in steps:
        assert {"step", "rank", "loss", "step_time_s", "phases_s"} <= set(record)
        # The phases add up to the measured step time.
        assert sum(record["phases_s"].values()) == pytest.approx(record["step_time_s"], rel=1e-6)
        assert record["phases_s"]["forward"] > 0 and record["phases_s"]["backward"] > 0
    measured = [s for s in steps if not s["warmup"]]
    assert summary["samples_per_s"] == pytest.approx(
        sum(s["samples"] for s in measured) / sum(s["step_time_s"] for s in measured)
    )
    assert summary["eval"]["runs"][0]["samples"] == 64
    assert 0.0 <= summary["eval"]["accuracy"] <= 1.0


def test_training_learns_the_synthetic_task(tiny_scenario, tmp_path):
    summary, steps = run(
        tiny_scenario,
        tmp_path,
        "train.steps=40",
        "train.eval.at_end=true",
        "model.width=8",
    )
    first = sum(s["loss"] for s in steps[:4]) / 4
    last = sum(s["loss"] for s in steps[-4:]) / 4
    assert last < 0.7 * first
    assert summary["eval"]["accuracy"] > 0.5  # four classes: chance is 0.25


def test_eval_every_n_steps_and_bf16(tiny_scenario, tmp_path):
    summary, steps = run(tiny_scenario, tmp_path, "train.eval.every=3", "train.precision=bf16")
    assert [r["step"] for r in summary["eval"]["runs"]] == [3, 6]
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in steps)


def test_hooks_see_every_event_in_loop_order(tiny_scenario, tmp_path):
    run(tiny_scenario, tmp_path, "optimizations.toy_probe.intensity=1", "train.eval.every=4")
    probe = json.loads((tmp_path / "run" / "probe-rank0.json").read_text())
    events = [e for _, e in probe["events"]]
    one_step = [
        "step_start",
        "after_data",
        "before_forward",
        "after_forward",
        "before_backward",
        "after_backward",
        "before_optimizer_step",
        "after_optimizer_step",
        "step_end",
    ]
    assert events[0] == "fit_start" and events[-1] == "fit_end"
    assert events[1:10] == one_step
    assert events.count("step_end") == 8
    assert events.count("eval_start") == events.count("eval_end") == 2
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["optimizations"]["toy_probe"]["depth"] == 16
    assert summary["scheduler"]["hooks"]["toy_probe"]["step_start"]["calls"] == 8
    assert not (tmp_path / "run" / "trace.json").exists()  # only when the scenario asks


def test_scheduler_trace_writes_every_hook_that_ran_in_chrome_format(tiny_scenario, tmp_path):
    run(
        tiny_scenario,
        tmp_path,
        "scheduler.trace=true",
        "optimizations.toy_probe.intensity=1",
        "optimizations.checkpoint={every: 3}",
        "train.steps=3",
        "train.eval.every=2",
    )
    trace = json.loads((tmp_path / "run" / "trace.json").read_text())
    events = trace["traceEvents"]  # what chrome://tracing and Perfetto open
    for event in events:
        assert event["ph"] == "X" and event["dur"] >= 0 and event["ts"] >= 0, event
        assert {"pid", "tid", "cat"} <= set(event)
    # Every hook that ran, once per call: the probe's own record of its hooks, and the
    # checkpoint's (it has no hook at the forward or backward events).
    ran = sorted(
        (e["args"]["step"], e["name"].removeprefix("toy_probe."))
        for e in events
        if e["name"].startswith("toy_probe.")
    )
    probe = json.loads((tmp_path / "run" / "probe-rank0.json").read_text())
    assert ran == sorted((step, event) for step, event in probe["events"])
    checkpoint = [e["name"] for e in events if e["name"].startswith("checkpoint.")]
    assert checkpoint.count("checkpoint.step_start") == 5  # 2 warm-up + 3 measured
    assert {"checkpoint.fit_start", "checkpoint.fit_end"} <= set(checkpoint)
    assert not any("forward" in name for name in checkpoint)
    assert {e["name"].split(".")[0] for e in events} == {"toy_probe", "checkpoint"}


@pytest.mark.parametrize(
    "name",
    ["resnet18-cifar", "resnet18-imagenet", "resnet50-cifar", "resnet50-imagenet", "bert-imdb"],
)
def test_matrix_scenarios_run_at_small_scale_with_their_documented_overrides(name, tmp_path):
    from conftest import ROOT

    path = ROOT / "scenarios" / f"{name}.yaml"
    header = next(line for line in path.read_text().splitlines() if "Small scale" in line)
    overrides = header.split("--set")[1:]
    assert overrides, header
    overrides = [o.strip() for o in overrides]
    overrides += [
        "train.steps=2",
        "train.warmup_steps=1",
        "world.nprocs=1",
        "data.num_samples=64",
        "data.eval_samples=16",
        "train.eval.at_end=true",
    ]
    scenario = load_scenario(path, overrides)
    summary = run_scenario(scenario, tmp_path / name, progress=False, print_summary=False)
    assert summary["steps"] == 2 and summary["eval"]["runs"][0]["samples"] == 16
