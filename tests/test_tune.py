"""overlapkit tune and report: the search space, goodput, a study end to end,
workers sharing a study, failed trials, an interrupted study, the report."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
import sqlalchemy
import yaml
from optuna.trial import FrozenTrial, TrialState
from pg_server import throwaway_postgres

from conftest import (
    ROOT,
    TINY_SCENARIO,
    cli_here,
    dashboard_get,
    most_at_once,
    run_cli,
    running,
)
from overlapkit.tuning import TuneConfig, TuneError
from overlapkit.tuning.analysis import Analysis
from overlapkit.tuning.checkpoint_model import daly_interval
from overlapkit.tuning.goodput import checkpoint_figures, checkpoints_taken, efficiency, goodput
from overlapkit.tuning.phases import enqueue
from overlapkit.tuning.space import SpaceError, apply_params, build_space
from overlapkit.tuning.study import (
    Objective,
    TrialTakenWarning,
    TuneJob,
    default_storage,
    open_storage,
    open_study,
    queue_again,
    search_done,
    trial_metrics,
    waiting,
    worker_main,
)
from overlapkit.tuning.trial import TrialFailed


def scenario_with(tiny_scenario, optimizations: str, tune: str):
    return tiny_scenario(TINY_SCENARIO + f"optimizations: {optimizations}\ntune: {tune}\n")


def tune_tiny(tiny_scenario, tmp_path, optimizations: str, tune: str, *extra):
    """`overlapkit tune` on the tiny scenario with these optimizations and tune
    section, into tmp_path/tune; it must succeed. Returns that folder."""
    out = tmp_path / "tune"
    path = scenario_with(tiny_scenario, optimizations, tune)
    result = run_cli("tune", path, "--out", out, *extra, timeout=600)
    assert result.returncode == 0, result.stderr
    (out / "tune-stderr.txt").write_text(result.stderr)
    return out


def load(folder, name="tiny"):
    return optuna.load_study(
        study_name=name, storage=open_storage(f"sqlite:///{folder / 'study.db'}")
    )


# --------------------------------------------------------------------- goodput
def test_goodput_on_known_inputs():
    # Every 10 s, a 2 s persist, a 60 s restart, MTBF 1 h: Daly's expected time per segment.
    share = efficiency(10.0, 2.0, 60.0, mtbf_s=3600, job_s=86400)
    assert share == pytest.approx(10 / ((3600 + 62) * math.expm1(10 / 3600)))
    # ... which is, to first order, 1 - (interval/2 + persist + restart) / MTBF.
    assert share == pytest.approx(1 - (5 + 2 + 60) / 3600, abs=1e-3)
    assert goodput(1000.0, share) == pytest.approx(1000 * share)
    # No checkpoints: the 2 h job is one segment, 30 % of the throughput survives.
    none = efficiency(None, 0.0, 60.0, mtbf_s=3600, job_s=7200)
    assert none == pytest.approx(7200 / (3660 * math.expm1(2)))
    assert 0.30 < none < 0.31
    assert efficiency(None, 0.0, 0.0, mtbf_s=60, job_s=10**6) == 0.0  # overflow: nothing
    assert efficiency(10.0, 0.0, 0.0, mtbf_s=1e12, job_s=1) == pytest.approx(1.0)  # no failures
    # From a run's summary: every 10 steps of 0.5 s, a 2 s persist, MTBF 1 h.
    summary = {
        "samples_per_s": 800.0,
        "step_time_s": {"mean": 0.5},
        "phase_shares": {"forward": 0.5},
        "scheduler": {"policy": "free"},
        "optimizations": {"checkpoint": {"every": 10, "persist_s_mean": 2.0}},
    }
    tune = TuneConfig(mtbf_hours=1.0, restart_s=30.0, job_hours=4.0)
    metrics = trial_metrics(summary, tune)
    assert metrics["checkpoint_interval_s"] == 5.0
    assert metrics["efficiency"] == pytest.approx(efficiency(5.0, 2.0, 30.0, 3600, 4 * 3600))
    assert metrics["goodput"] == pytest.approx(800 * metrics["efficiency"])
    # The same throughput without checkpoints keeps 7 % over a 4 h job at this MTBF:
    # frequent checkpoints win even at a much lower throughput.
    del summary["optimizations"]["checkpoint"]
    assert trial_metrics(summary, tune)["goodput"] == pytest.approx(
        800 * 4 / ((1 + 30 / 3600) * math.expm1(4))
    )
    assert trial_metrics(summary, tune)["goodput"] < 0.1 * metrics["goodput"]


def test_an_auto_interval_never_chosen_is_not_priced_as_the_unused_every():
    summary = {
        "samples_per_s": 800.0,
        "step_time_s": {"mean": 0.5},
        "optimizations": {
            "checkpoint": {
                "every": 100,  # the default, unused in auto mode
                "checkpoints": 0,
                "persist_s_mean": 0.0,
                "auto_policy": {"interval": None, "measured_overhead": None, "history": []},
            }
        },
    }
    assert checkpoint_figures(summary) == (None, 0.0)
    assert checkpoints_taken(summary) == 0
    summary["optimizations"]["checkpoint"]["auto_policy"]["interval"] = 7
    assert checkpoint_figures(summary) == (3.5, 0.0)
    assert checkpoints_taken({"optimizations": {}}) is None


def test_checkpoint_intervals_longer_than_a_trial_are_found_before_it_starts(tmp_path):
    base = {**yaml.safe_load(TINY_SCENARIO), "optimizations": {"checkpoint": {}}}

    def job(**tune):
        return TuneJob(base, TuneConfig(**tune), tmp_path, default_storage(tmp_path), "tiny")

    # Intensities 0.25, 0.5, 0.75, 1: every 178, 32, 6, 1 steps; a trial runs 12 + 3.
    assert job(intensity_step=0.25).rare_checkpoints() == [32, 178]
    assert job(intensity_step=0.25, steps=40).rare_checkpoints() == [178]
    assert job(intensity_step=0.5, steps=40).rare_checkpoints() == []
    raw = {"checkpoint": {"every": [2, 8, 42, 43, 50]}}  # steps 0-42: 43 is never reached
    assert job(search=raw, steps=40).rare_checkpoints() == [43, 50]


def test_a_knob_left_idle_by_a_trials_setting_is_dropped_or_refused():
    # The README's spelling, tuned by intensity: the intensity replaces every: auto, so
    # each trial drops max_overhead instead of failing on it.
    base = {"optimizations": {"checkpoint": {"every": "auto", "max_overhead": 0.02}}}
    space = build_space(base["optimizations"], TuneConfig(policy=False))
    trial = apply_params(base, space, {"checkpoint.intensity": 0.5})
    assert trial["optimizations"]["checkpoint"] == {"intensity": 0.5}
    # Searched raw with auto off in some setting (in either order): refused before any trial.
    for auto in ([False, True], [True, False]):
        search = {"checkpoint": {"auto": auto, "max_overhead": [0.01, 0.05]}}
        with pytest.raises(SpaceError, match="max_overhead means something only when auto"):
            build_space({"checkpoint": {"every": 5}}, TuneConfig(search=search))
    # The README's [intensity, comm_hook]: at intensity 0 ddp_overlap is its no_overlap
    # baseline, which has no hook: the trial drops the hook (it was refused, exit 2).
    base = {"optimizations": {"ddp_overlap": None}}
    search = {"ddp_overlap": ["intensity", "comm_hook"]}
    space = build_space(base["optimizations"], TuneConfig(search=search, policy=False))
    off = apply_params(base, space, {"ddp_overlap.intensity": 0.0, "ddp_overlap.comm_hook": "fp16"})
    on = apply_params(base, space, {"ddp_overlap.intensity": 0.5, "ddp_overlap.comm_hook": "fp16"})
    assert off["optimizations"]["ddp_overlap"] == {"intensity": 0.0}
    assert on["optimizations"]["ddp_overlap"] == {"intensity": 0.5, "comm_hook": "fp16"}


def test_a_study_measured_with_another_scenario_is_not_continued(tmp_path):
    base = {**yaml.safe_load(TINY_SCENARIO), "optimizations": {"checkpoint": {}}}
    storage = default_storage(tmp_path)
    open_study(TuneJob(base, TuneConfig(trials=2), tmp_path, storage, "tiny"))
    # More trials continue it; another model would mix two models' measurements.
    open_study(TuneJob(base, TuneConfig(trials=20), tmp_path, storage, "tiny"))
    # Where TensorBoard files go does not change what a trial measures.
    logged = {**base, "log": {"tensorboard": str(tmp_path / "tb")}}
    open_study(TuneJob(logged, TuneConfig(trials=20), tmp_path, storage, "tiny"))
    wider = {**base, "model": {**base["model"], "width": 16}}
    with pytest.raises(TuneError, match=r"measured with another scenario \(model.width 4 -> 16\)"):
        open_study(TuneJob(wider, TuneConfig(trials=2), tmp_path, storage, "tiny"))


def test_a_search_of_what_the_set_up_cannot_run_is_refused_by_check_and_tune(
    tiny_scenario, tmp_path
):
    """pipeline on one rank: check listed it as left out and searched it anyway; every
    trial failed and the report still named a best setting and where overlap stops."""
    scenario = tiny_scenario()
    for command, search in (("check", "pipeline: [intensity]"), ("tune", "ddp_overlap: null")):
        extra = ["--out", tmp_path / "tune"] if command == "tune" else []
        result = cli_here(command, scenario, "--set", f"tune.search={{{search}}}", *extra)
        assert result.returncode == 2, result.stderr
        assert "tune.search names what this set-up cannot tune" in result.stderr
    assert (
        "pipeline needs at least 2 ranks"
        in cli_here("check", scenario, "--set", "tune.search={pipeline: [intensity]}").stderr
    )
    assert not (tmp_path / "tune").exists()


def test_a_tune_folder_copied_elsewhere_reads_its_own_study(tmp_path):
    """tune.json named its study.db by absolute path: a copy of the folder reported
    the original's study, and once the original was gone, none."""
    import shutil

    from overlapkit.tuning.commands import load_target

    base = {**yaml.safe_load(TINY_SCENARIO), "optimizations": {"checkpoint": {}}}
    original, copy = tmp_path / "a", tmp_path / "b"
    job = TuneJob(base, TuneConfig(trials=2), original, default_storage(original), "tiny")
    job.save()
    open_study(job).set_user_attr("which", "a")
    assert json.loads((original / "tune.json").read_text())["storage"] is None
    shutil.copytree(original, copy)
    optuna.load_study(study_name="tiny", storage=default_storage(copy)).set_user_attr("which", "b")
    assert load_target(str(copy))[0].user_attrs["which"] == "b"
    shutil.rmtree(original)
    assert load_target(str(copy))[0].user_attrs["which"] == "b"
    # Another storage, named on purpose, stays named by its URL.
    elsewhere = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    TuneJob(base, TuneConfig(trials=2), tmp_path / "c", elsewhere, "tiny").save()
    assert json.loads((tmp_path / "c" / "tune.json").read_text())["storage"] == elsewhere


def test_run_and_tune_folders_are_not_mixed(tmp_path, tiny_scenario):
    """tune --out a run's folder put study.db and trials/ among the run's files, and
    run --out a tune folder wrote a run's files into it."""
    scenario = tiny_scenario()
    run = tmp_path / "run"
    assert run_cli("run", scenario, "--out", run, "--quiet").returncode == 0
    before = sorted(p.name for p in run.iterdir())
    tune = cli_here("tune", scenario, "--out", run)
    assert tune.returncode == 2 and "holds a run (scenario.yaml), not a tune" in tune.stderr
    assert sorted(p.name for p in run.iterdir()) == before
    folder = tmp_path / "tune"
    base = {**yaml.safe_load(TINY_SCENARIO), "optimizations": {"checkpoint": {}}}
    TuneJob(base, TuneConfig(), folder, default_storage(folder), "tiny").save()
    into = cli_here("run", scenario, "--out", folder)
    assert into.returncode == 2 and "holds tune.json, and no earlier run" in into.stderr


def test_a_tune_folder_holding_another_study_is_left_alone(tmp_path, tiny_scenario):
    base = {**yaml.safe_load(TINY_SCENARIO), "optimizations": {"checkpoint": {}}}
    folder = tmp_path / "tune"
    TuneJob(base, TuneConfig(), folder, default_storage(folder), "other").save()
    before = (folder / "tune.json").read_text()
    scenario = tiny_scenario(TINY_SCENARIO + "optimizations: {checkpoint: {}}\n")
    result = cli_here("tune", scenario, "--out", folder)
    assert result.returncode == 2, result.stderr
    assert "holds the study 'other'" in result.stderr and "--study other" in result.stderr
    assert (folder / "tune.json").read_text() == before and not (folder / "trials").exists()
    # The same study name in another storage: the hint names the storage.
    elsewhere = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    result = cli_here("tune", scenario, "--out", folder, "--study", "other", "--storage", elsewhere)
    assert result.returncode == 2 and f"--storage {default_storage(folder)}" in result.stderr
    assert (folder / "tune.json").read_text() == before


@pytest.mark.parametrize(
    ("objective", "pruner"),
    [
        ("throughput", optuna.pruners.MedianPruner),
        ("goodput", optuna.pruners.NopPruner),
        ("both", optuna.pruners.NopPruner),
    ],
)
def test_only_throughput_studies_are_pruned_on_the_running_throughput(tmp_path, objective, pruner):
    base = {**yaml.safe_load(TINY_SCENARIO), "optimizations": {"checkpoint": {}}}
    job = TuneJob(
        base,
        TuneConfig(objective=objective, prune=True, checkpoint_interval="search"),
        tmp_path,
        default_storage(tmp_path),
        "tiny",
    )
    assert type(open_study(job).pruner) is pruner


# ------------------------------------------------------------------------ space
def test_the_space_comes_from_the_knob_declarations():
    tune = TuneConfig(
        search={
            "checkpoint": {"every": [1, 5, 20]},
            "ddp_overlap": ["intensity", "comm_hook"],
            "toy_probe": {"depth": {"low": 2, "high": 16, "log": True}},
        },
        intensity_step=0.5,
    )
    space = build_space({}, tune)
    dims = {d.name: d for d in space.dimensions}
    assert list(dims) == [
        "checkpoint.on",
        "checkpoint.every",
        "ddp_overlap.intensity",
        "ddp_overlap.comm_hook",
        "toy_probe.on",
        "toy_probe.depth",
        "scheduler.policy",
    ]
    assert dims["checkpoint.every"].values() == [1, 5, 20]
    assert dims["ddp_overlap.intensity"].values() == [0.0, 0.5, 1.0]
    assert "fp16" in dims["ddp_overlap.comm_hook"].values()  # the declared choices
    assert dims["toy_probe.depth"].values() == [2, 3, 6, 10, 16]  # log-spaced
    assert dims["scheduler.policy"].values() == ["free", "priority", "partition"]
    assert space.level("checkpoint").name == "checkpoint.every"
    # By default: each optimization of the scenario by its intensity.
    default = build_space({"checkpoint": {"every": 3}, "prefetch": None}, TuneConfig(policy=False))
    assert [d.name for d in default.dimensions] == ["checkpoint.intensity", "prefetch.intensity"]


def test_declared_choices_the_setup_refuses_are_not_searched():
    """A bf16 comm_hook needs nccl: on gloo its trials could only be refused (exit 2),
    so the searched choices leave it out, with a note; on nccl it stays. Choices the
    user listed, and other knobs, are left as given."""
    from overlapkit.tuning.space import runnable_search

    search = {"ddp_overlap": ["intensity", "comm_hook"], "checkpoint": {"every": [1, 5]}}
    on_gloo, notes = runnable_search(search, {}, (2, "cpu", "gloo"))
    assert on_gloo["ddp_overlap"] == {"intensity": None, "comm_hook": ["none", "fp16", "powersgd"]}
    assert on_gloo["checkpoint"] == {"every": [1, 5]}
    assert len(notes) == 1 and "left out bf16" in notes[0] and "nccl" in notes[0]
    space = build_space({}, TuneConfig(search=on_gloo))
    assert "bf16" not in space.dimensions[1].values()
    on_nccl, notes = runnable_search(search, {}, (2, "cuda", "nccl"))
    assert on_nccl["ddp_overlap"]["comm_hook"] is None and notes == []  # every declared one
    listed = {"ddp_overlap": {"comm_hook": ["bf16", "fp16"]}}  # the user's own list: kept
    assert runnable_search(listed, {}, (2, "cpu", "gloo"))[0] == listed


def test_the_space_on_tensorflow_holds_only_what_runs_there():
    """On TensorFlow priority runs as free, so the policy is not searched; a torch-only
    knob or an optimization TensorFlow lacks is refused with the reason."""
    tune = TuneConfig(search={"ddp_overlap": ["intensity", "implementation"]})
    tf_space = build_space({}, tune, "tensorflow")
    assert [d.name for d in tf_space.dimensions] == [
        "ddp_overlap.intensity",
        "ddp_overlap.implementation",
    ]
    assert "scheduler.policy" in [
        d.name for d in build_space({"prefetch": {}}, TuneConfig()).dimensions
    ]
    with pytest.raises(SpaceError, match="implementation is a knob of tensorflow only"):
        build_space({}, tune, "torch")
    with pytest.raises(SpaceError, match="comm_hook is a knob of torch only"):
        build_space({}, TuneConfig(search={"ddp_overlap": ["comm_hook"]}), "tensorflow")
    with pytest.raises(SpaceError, match="pipeline cannot be searched on tensorflow"):
        build_space({"pipeline": {"stages": 2}}, TuneConfig(), "tensorflow")


def test_the_study_plan_bounds_each_phase_and_time_left_comes_from_finished_trials():
    from overlapkit.tuning.phases import analysis_settings, reference_settings
    from overlapkit.tuning.progress import StudyPlan, time_left

    tune = TuneConfig(trials=4, intensity_step=0.5, repeats=2, max_repeats=3, finalists=3)
    space = build_space({"ddp_overlap": {}, "prefetch": {}, "checkpoint": {}}, tune)
    plan = StudyPlan.of(space, tune)
    assert plan.counts["references"] == len(reference_settings(space))  # exact
    assert plan.counts["search"] == 4 + 0  # a control after every 5: none within 4
    # The race: finalists + 5 comparison rows, at most 3 rounds.
    assert plan.counts["confirm round 1"] == (3 + 5) * 3
    center = space.setting({"scheduler.policy": "priority"}, ddp_overlap=0.5, prefetch=1.0)
    around = analysis_settings(
        space, center, {"ddp_overlap": 0.5, "prefetch": 1.0, "checkpoint": 1.0}
    )
    # The analysis round: the center and each setting around it, once.
    assert len({str(sorted(p.items())) for _, p in around}) + 1 <= plan.counts["analysis"]
    assert plan.describe().startswith(
        f"up to {plan.total} trials: 8 references, 4 search, then up to 24 confirm"
    )
    plan.started("references", 2)
    assert plan.counts["references"] == 2 and plan.total == 2 + 4 + 24 + plan.counts["analysis"]
    searching = StudyPlan.of(space, tune.model_copy(update={"trials": 16}))
    assert searching.counts["search"] == 16 + 3  # controls after 5, 10 and 15
    # A goodput study whose checkpoint interval the model sets: its probes come first.
    modelled = TuneConfig(trials=4, objective="goodput", probes=2)
    space = build_space({"ddp_overlap": {}, "checkpoint": {}}, modelled)
    probed = StudyPlan.of(space, modelled, probes=True)
    assert probed.describe().startswith(f"up to {probed.total} trials: 4 probes, ")
    # Trials a stopped run queued are in their phase's bound already: not counted twice.
    from rich.console import Console

    from overlapkit.tuning.progress import StudyProgress

    before = plan.total
    StudyProgress(plan, 0, 1, Console(file=io.StringIO())).phase("queued earlier", 3)
    assert plan.total == before
    # Time left: the median trial (outliers aside) per remaining trial, 2 at once.
    assert time_left([], 10, 2) is None
    assert time_left([10.0, 12.0, 300.0], 5, 2) == 12.0 * 3


def test_a_trials_scenario_applies_the_setting():
    base = {
        "name": "s",
        "optimizations": {"checkpoint": {"every": 3, "dir": "ck"}, "prefetch": {"workers": 2}},
    }
    space = build_space(base["optimizations"], TuneConfig())
    params = {
        "checkpoint.intensity": 0.5,
        "prefetch.intensity": 0.0,
        "scheduler.policy": "priority",
    }
    data = apply_params(base, space, params)
    # The intensity replaces the knobs it maps (every), the others stay (dir).
    assert data["optimizations"]["checkpoint"] == {"dir": "ck", "intensity": 0.5}
    # prefetch at 0 is a mode of its own (synchronous loading), not removed.
    assert data["optimizations"]["prefetch"] == {"intensity": 0.0}
    assert data["scheduler"]["policy"] == "priority"
    off = apply_params(base, space, {**params, "checkpoint.intensity": 0.0})
    assert "checkpoint" not in off["optimizations"]
    assert base["optimizations"]["checkpoint"] == {"every": 3, "dir": "ck"}  # untouched


@pytest.mark.parametrize(
    ("tune", "expected"),
    [
        (
            "{search: {checkpoint: [evry]}}",
            "tune.search.checkpoint.evry: checkpoint has no knob 'evry'",
        ),
        ("{search: {checkpoint: [dir]}}", "declares no range or choices"),
        ("{search: {nope: [intensity]}}", "tune.search.nope"),
        ("{search: {checkpoint: {every: {low: 5, high: 2}}}}", "the range of every is empty"),
        (
            "{search: {checkpoint: {every: {low: 2, high: 2}}}}",
            "the range of every holds one value (2)",
        ),
        ("{search: {checkpoint: {every: []}}}", "the list of every values to search is empty"),
        ("{search: {}}", "tune.search names no optimization"),
    ],
)
def test_a_bad_search_names_the_line_and_what_is_allowed(tiny_scenario, tune, expected):
    path = scenario_with(tiny_scenario, "{checkpoint: {every: 2}}", tune)
    result = cli_here("check", path)
    assert result.returncode == 2
    assert expected in result.stderr
    assert f"{path}:13" in result.stderr.replace("\n", "")  # the tune line
    with pytest.raises(SpaceError):
        build_space({}, TuneConfig(**yaml.safe_load(tune)))


# -------------------------------------------------------------------- end to end
def test_without_rounds_the_best_is_the_best_median_among_settings_measured_again():
    """A study without side-by-side rounds (tune.repeats: 1, or read before its race):
    one lucky measurement does not win; the best is the best median among the settings
    measured `repeats` times."""
    tune = TuneConfig(intensity_step=0.5, finalists=2, repeats=3, policy=False)
    space = build_space({"ddp_overlap": {}, "prefetch": {}}, tune)
    study = optuna.create_study(direction="maximize")
    study.set_user_attr("objectives", ["throughput"])
    study.set_user_attr("tune", tune.model_dump(mode="json"))
    distributions = {
        d.name: optuna.distributions.FloatDistribution(d.low, d.high, step=d.step)
        for d in space.dimensions
    }

    def measure(role, value, ddp, prefetch):
        params = {"ddp_overlap.intensity": ddp, "prefetch.intensity": prefetch}
        attrs = {"role": role, "throughput": value, "goodput": value}
        study.add_trial(
            optuna.trial.create_trial(
                params=params, distributions=distributions, value=value, user_attrs=attrs
            )
        )

    measure("baseline", 100, 0.0, 0.0)
    measure("alone:ddp_overlap", 120, 1.0, 0.0)
    measure("alone:prefetch", 90, 0.0, 1.0)
    measure("all_on", 110, 1.0, 1.0)
    measure("search", 150, 1.0, 0.0)  # ddp alone again, a lucky 150: median of (120, 150) = 120
    analysis = Analysis.of(study, space)
    assert (
        analysis.lookup({"ddp_overlap.intensity": 1.0, "prefetch.intensity": 0.0}).throughput == 120
    )
    assert analysis.best.throughput == 120  # nothing confirmed yet: the best median
    for value, ddp, prefetch in [(112, 1.0, 1.0), (95, 0, 0), (88, 0, 1.0), (101, 0, 0), (91, 0, 1.0), (118, 1.0, 0), (108, 1.0, 1.0)]:  # fmt: skip
        measure("repeat", value, ddp, prefetch)
    analysis = Analysis.of(study, space)
    assert analysis.race is None  # no rounds: judged by medians
    # all_on: 110, 112, 108 -> 110; ddp alone: 120, 150, 118 -> 120; the best is ddp alone.
    assert analysis.best.params == {"ddp_overlap.intensity": 1.0, "prefetch.intensity": 0.0}
    assert analysis.best.throughput == 120
    rows = {row["row"]: row for row in analysis.comparison()}
    assert rows["tuned best"]["measured"] == 3
    assert (rows["tuned best"]["low"], rows["tuned best"]["high"]) == (118, 150)
    assert rows["all on, full (naive)"]["throughput"] == 110
    # A lucky single measurement above every median is not chosen over confirmed ones.
    measure("search", 400, 0.0, 0.0)  # baseline: 100, 95, 101, 400 -> 100 (lower median)
    analysis = Analysis.of(study, space)
    assert analysis.best.throughput == 120
    # A setting the analysis phase found (130, 131) wins once measured `repeats` times;
    # the analysis center (its curves' setting) stays the search's best.
    measure("sweep:ddp_overlap", 130, 0.5, 0.0)
    measure("repeat:analysis", 135, 0.5, 0.0)
    assert Analysis.of(study, space).best.throughput == 120  # not confirmed yet
    measure("repeat:analysis", 131, 0.5, 0.0)
    analysis = Analysis.of(study, space)
    assert analysis.best.throughput == 131 and analysis.center.throughput == 120
    # Noise: each repeated setting's range of log-values / d2(n), the median of those
    # (the baseline's wild 400 is one setting of five: it does not set the noise).
    sigmas = [
        math.log(150 / 118) / 1.693,
        math.log(112 / 108) / 1.693,
        math.log(400 / 95) / 2.059,
        math.log(91 / 88) / 1.693,
        math.log(135 / 130) / 1.693,
    ]
    assert analysis.noise == pytest.approx(statistics.median(sigmas))
    assert analysis.flagged(analysis.spread(analysis.baseline.params))  # 95..400 disagree


def test_a_trial_process_that_dies_before_writing_anything_fails_only_that_trial(
    tmp_path, monkeypatch
):
    """A trial's process that exits before its run writes stderr.txt (an import error
    in a half-updated install) is that trial's failure, not the study's crash."""
    from overlapkit.tuning import trial

    def start(command, stdout, stderr, env, fork, cores=None):  # a real process writing nothing
        return subprocess.Popen(["sh", "-c", "exit 3"], start_new_session=True)

    monkeypatch.setattr(trial, "start_trial_process", start)
    with pytest.raises(trial.TrialFailed) as failed:
        trial.run_trial({"name": "x"}, tmp_path / "t", timeout_s=30)
    assert failed.value.kind == "crashed"
    assert "exit status 3" in failed.value.reason and "(nothing on stderr)" in failed.value.reason


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("fork", [True, False], ids=["forked", "fresh interpreter"])
def test_a_trial_process_dies_with_the_tune_that_started_it(fork, tmp_path):
    """A tune killed (SIGKILL, the OOM killer) left its running trial behind, in a
    session of its own: it ran on beside the next tune's trials and slowed them."""
    started = tmp_path / "started"
    (tmp_path / "hold_the_trial.py").write_text(  # the trial's run loads it, then waits
        f"import os, time\nopen({str(started)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n"
    )
    program = textwrap.dedent(
        f"""
        import os, time
        from overlapkit.tuning import trial_process

        env = {{**os.environ, "OVERLAPKIT_PLUGINS": "hold_the_trial"}}
        out, err = {str(tmp_path / "out.txt")!r}, {str(tmp_path / "err.txt")!r}
        trial_process.start_trial_process(["list"], out, err, env, fork={fork})
        time.sleep(600)  # as tune, watching its trial
        """
    )
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    tune = subprocess.Popen(
        [sys.executable, "-c", program],
        env={**os.environ, "PYTHONPATH": path},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not started.exists() or not started.read_text():
            assert time.monotonic() < deadline and tune.poll() is None, "no trial started"
            time.sleep(0.1)
        pid = int(started.read_text())
        os.kill(tune.pid, signal.SIGKILL)  # tune only: the trial has a session of its own
        deadline = time.monotonic() + 30
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(pid), "the trial outlived the tune that started it"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(tune.pid, signal.SIGKILL)
        tune.wait()
        if started.exists() and started.read_text() and running(int(started.read_text())):
            os.kill(int(started.read_text()), signal.SIGKILL)


def _fake(trial, space, results):
    """An objective that records the next of ``results`` as the trial's measurement."""
    space.suggest(trial)
    value = next(results)
    trial.set_user_attr("throughput", value)
    trial.set_user_attr("goodput", value)
    return value


@pytest.mark.slow
def test_a_tiny_study_runs_end_to_end_and_reports(tiny_scenario, tmp_path):
    out = tune_tiny(
        tiny_scenario,
        tmp_path,
        "{toy_sleep: {intensity: 1}, checkpoint: {every: 2}}",
        "{trials: 2, intensity_step: 1, steps: 4, warmup_steps: 1, objective: both, mtbf_hours: 2, job_hours: 1, finalists: 1, repeats: 2, checkpoint_interval: search}",
        "--tensorboard",
        tmp_path / "board",
    )
    for name in (
        "report.md",
        "report.html",
        "report.json",
        "best.yaml",
        "contention.png",
        "history.png",
        "pareto.png",
        "study.db",
    ):
        assert (out / name).stat().st_size > 0, name
    # The phases were announced up front, and the study kept within them.
    announced = re.search(
        r"up to (\d+) trials: (\d+) references, 2 search, then up to",
        (out / "tune-stderr.txt").read_text(),
    )
    assert announced, (out / "tune-stderr.txt").read_text()[:2000]
    ran = [t for t in load(out).trials if t.user_attrs.get("role") != "unused"]
    assert len(ran) <= int(announced[1])
    # Each trial is a TensorBoard run of its own, its steps read back from the event files.
    boards = sorted(p.name for p in (tmp_path / "board").iterdir())
    assert boards == [f"trial-{t.number:05d}" for t in ran]
    from test_tensorboard import scalars

    assert [step for step, _ in scalars(tmp_path / "board" / boards[-1])["train/loss"]] == [
        0,
        1,
        2,
        3,
        4,
    ]  # 1 warm-up + 4 measured steps
    assert sum(
        t.user_attrs.get("role", "").startswith("alone:")
        or t.user_attrs.get("role") in ("baseline", "all_on")
        for t in ran
    ) == int(announced[2])
    document = json.loads((out / "report.json").read_text())
    rows = {row["row"]: row for row in document["comparison"]}
    assert list(rows) == [
        "baseline (all off)",
        "toy_sleep alone",
        "checkpoint alone",
        "all on, full (naive)",
        "tuned best",
    ]
    for row in rows.values():
        assert row["throughput"] > 0 and row["goodput"] >= 0 and row["vs_baseline"] > 0, row
        # Every row raced side by side (the confirm phase): its value is the rounds'
        # paired fit (in an average round), with the range of its measurements there.
        assert row["measured"] == row["side_by_side"] >= 2 and row["low"] <= row["high"], row
        low, high = row["vs_baseline_interval"]
        assert low <= row["vs_baseline"] <= high, row
    assert document["best"]["measured"] >= 2 and document["noise"] is not None
    # 200 ms of sleep per step is never worth it: the tuned best has it off.
    assert document["best"]["params"]["toy_sleep.intensity"] == 0.0
    # Two objectives: a Pareto front. At a 2 h MTBF a 1 h job without checkpoints keeps
    # 76 % of its throughput; checkpoints every step lose almost nothing.
    assert document["pareto"]
    baseline = rows["baseline (all off)"]
    kept = 3600 / ((7200 + 60) * math.expm1(0.5))
    assert baseline["goodput"] == pytest.approx(baseline["throughput"] * kept)
    assert document["curves"]["toy_sleep"]["contention_point"] == 0.0
    assert set(document["policy"]) == {"free", "priority", "partition"}
    # Pairwise interactions: each pair's gains over the baseline, alone and together (the
    # rows' medians), and together / (gain A x gain B) - 1.
    base_goodput = rows["baseline (all off)"]["goodput"]
    (pair,) = document["interactions"]
    assert (pair["a"], pair["b"]) == ("toy_sleep", "checkpoint")
    assert pair["gain_a"] == pytest.approx(rows["toy_sleep alone"]["goodput"] / base_goodput)
    assert pair["gain_b"] == pytest.approx(rows["checkpoint alone"]["goodput"] / base_goodput)
    together = rows["all on, full (naive)"]["goodput"] / base_goodput  # both at level 1
    assert pair["gain_together"] == pytest.approx(together)
    assert pair["interaction"] == pytest.approx(together / (pair["gain_a"] * pair["gain_b"]) - 1)
    # Knob importances (Optuna's, normalised): every searched knob, highest first.
    importances = document["importances"]
    assert set(importances) == {"toy_sleep.intensity", "checkpoint.intensity", "scheduler.policy"}
    assert all(v >= 0 for v in importances.values())
    assert sum(importances.values()) == pytest.approx(1.0)
    assert list(importances.values()) == sorted(importances.values(), reverse=True)
    markdown = (out / "report.md").read_text()
    assert "| toy_sleep | checkpoint |" in markdown and "## Knob importances" in markdown
    assert all(f"| {name} | {value:.3f} |" in markdown for name, value in importances.items())
    # Marked (!) when its own repeats disagree beyond the noise (on a loaded machine).
    flag = " (!)" if rows["tuned best"]["disagree"] else ""
    assert f"| tuned best{flag} |" in markdown and "contention.png" in markdown
    # Every trial kept its numbers, and the best setting is a runnable scenario.
    study = load(out)
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(complete) >= 6
    assert all("forward" in t.user_attrs["phase_shares"] for t in complete)
    # Each trial with the sleep on paid it in every step, as "other" (its throughput
    # against the baseline's is at the mercy of whatever else loads the machine).
    for t in complete:
        if t.params["toy_sleep.intensity"] == 1.0:
            attrs = t.user_attrs
            assert attrs["step_time_s"] * attrs["phase_shares"]["other"] >= 0.1999, attrs
    assert cli_here("check", out / "best.yaml").returncode == 0
    # optuna-dashboard reads the study as it is, trials and their attributes.
    status, body = dashboard_get(f"sqlite:///{out / 'study.db'}", "/api/studies/1")
    assert status == "200 OK"
    page = json.loads(body)
    assert page["name"] == "tiny" and len(page["trials"]) == len(study.trials)
    # The report command gives the same table from the folder or from the storage URL.
    again = cli_here("report", out, "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["comparison"] == document["comparison"]
    by_url = cli_here("report", f"sqlite:///{out / 'study.db'}", "--out", tmp_path / "r2")
    assert by_url.returncode == 0 and (tmp_path / "r2" / "report.md").exists()
    (tmp_path / "a-file").write_text("")
    on_file = cli_here("report", out, "--out", tmp_path / "a-file")
    assert on_file.returncode == 2 and "is a file; the report goes into a folder" in on_file.stderr
    # The same trials priced at a 1000 h MTBF: the baseline keeps almost everything.
    priced = cli_here("report", out, "--json", "--mtbf-hours", "1000", "--out", tmp_path / "r3")
    assert priced.returncode == 0, priced.stderr
    repriced = json.loads(priced.stdout)
    assert repriced["goodput_at"] == {"mtbf_hours": 1000.0, "restart_s": 60.0, "job_hours": 1.0}
    base = {row["row"]: row for row in repriced["comparison"]}["baseline (all off)"]
    kept = 3600 / ((3_600_000 + 60) * math.expm1(0.001))
    assert base["goodput"] == pytest.approx(base["throughput"] * kept) and kept > 0.99
    # ... and at a 10 min restart and a 3 h job: every row's goodput is its trial's
    # throughput x tau / E[T], E[T] = (MTBF + R + P) (e^(tau/MTBF) - 1), tau the
    # checkpoint interval (without checkpoints, the job), P the persist latency.
    priced = cli_here(
        "report", out, "--json", "--restart-s", "600", "--job-hours", "3", "--out", tmp_path / "r4"
    )
    assert priced.returncode == 0, priced.stderr
    repriced = json.loads(priced.stdout)
    assert repriced["goodput_at"] == {"mtbf_hours": 2.0, "restart_s": 600.0, "job_hours": 3.0}

    def priced(attrs):
        tau, persist = attrs["checkpoint_interval_s"], attrs["persist_s"]
        if tau is None:
            tau, persist = 3 * 3600, 0.0
        return attrs["throughput"] * tau / ((7200 + 600 + persist) * math.expm1(tau / 7200))

    # Every row raced side by side: its value is the paired fit of its rounds, each
    # measurement priced.
    from overlapkit.tuning.analysis import setting_key
    from overlapkit.tuning.paired import PairedFit

    blocked = [t for t in complete if t.user_attrs.get("block")]
    fit = PairedFit.of(
        (setting_key(t.params), t.user_attrs["block"], priced(t.user_attrs)) for t in blocked
    )
    for row in repriced["comparison"]:
        same = [t for t in blocked if t.params == row["params"]]
        assert len(same) == row["measured"] >= 2, row
        assert row["goodput"] == pytest.approx(fit.level(setting_key(row["params"]))), row
    base = {row["row"]: row for row in repriced["comparison"]}["baseline (all off)"]
    kept = 3 * 3600 / ((7200 + 600) * math.expm1(1.5))  # 40 % kept (it was 76 %)
    assert base["goodput"] == pytest.approx(base["throughput"] * kept) and kept < 0.41


@pytest.mark.slow
def test_a_goodput_study_checkpoints_every_trial_at_the_models_interval(tiny_scenario, tmp_path):
    """Real runs: probe trials checkpoint every few steps and their runs measure a
    checkpoint's cost; every other trial runs at the interval Daly's formula gives for
    it, the search leaves the checkpoint alone, and best.yaml checkpoints at the
    interval the pick's own cost gives."""
    out = tune_tiny(
        tiny_scenario,
        tmp_path,
        "{toy_sleep: {intensity: 1}, checkpoint: {every: 2}}",
        "{trials: 2, intensity_step: 1, steps: 8, max_steps: 40, warmup_steps: 1, objective: goodput, mtbf_hours: 1, job_hours: 4, restart_s: 30, finalists: 1, repeats: 2, max_repeats: 2, policy: false, seed: 0}",
    )
    study = load(out)
    assert "checkpoint.every" not in study.trials[-1].params  # not searched
    probes = [t for t in study.trials if t.user_attrs.get("role") == "probe"]
    assert probes and probes[0].user_attrs["probe_every"] == 4
    plan = study.user_attrs["checkpoint_plan"]
    assert plan["every"] == round(daly_interval(plan["cost_s"], 3600) / plan["step_s"])

    def every_of(trial):
        scenario = yaml.safe_load((Path(trial.user_attrs["folder"]) / "scenario.yaml").read_text())
        return scenario["optimizations"]["checkpoint"]["every"]

    for trial in study.trials:
        if trial.state == TrialState.COMPLETE:
            expected = trial.user_attrs["probe_every"] if trial in probes else plan["every"]
            assert every_of(trial) == expected, trial.number
            # A probe runs the longest window a trial may: the more checkpoints, the surer.
            assert trial.user_attrs["steps"] == (40 if trial in probes else trial.user_attrs["steps"])
    document = json.loads((out / "report.json").read_text())
    section = document["checkpoint"]
    assert section["alone"]["every"] == plan["every"] and section["trials_every"] == plan["every"]
    best = yaml.safe_load((out / "best.yaml").read_text())
    assert best["optimizations"]["checkpoint"]["every"] == section["every"]
    said = (out / "report.md").read_text()
    assert "Daly's interval at an MTBF of 1 h" in said
    # Measured by the probes, or said to be an upper bound: never silently assumed.
    assert ("measured by probe trial(s)" in said) == plan["measured"]
    assert ("an upper bound" in said) == (not plan["measured"])


@pytest.mark.slow
def test_a_grid_study_visits_every_point_then_confirms_its_finalists(tiny_scenario, tmp_path):
    out = tune_tiny(
        tiny_scenario,
        tmp_path,
        "{toy_sleep: {intensity: 1}}",
        # 4 measured steps: the finalists (0 and 125 ms of sleep a step, against 200) are
        # ranked on one trial each, which a stall of 150 ms in 2 steps could reorder.
        "{trials: 100, sampler: grid, references: false, policy: false, intensity_step: 0.5,"
        " finalists: 2, repeats: 2, max_repeats: 2, steps: 4, warmup_steps: 1}",
    )
    study = load(out)
    assert all(t.state == TrialState.COMPLETE for t in study.trials)
    searched = [
        t.params["toy_sleep.intensity"] for t in study.trials if t.user_attrs["role"] == "search"
    ]
    assert sorted(searched) == [0.0, 0.5, 1.0]  # the grid, each point once
    # Its heading says the grid's 3 trials, as the plan does (it said "search: 100 trials").
    assert "search: 3 trials on 1 worker(s)" in (out / "tune-stderr.txt").read_text()
    # The grid sampler stops a study once its grid is done; the confirm phase still
    # raced the 2 best (the least sleep) side by side, in 2 rounds.
    again = [
        (t.params["toy_sleep.intensity"], t.user_attrs["block"])
        for t in study.trials
        if t.user_attrs["role"] == "race"
    ]
    assert sorted(again) == [(0.0, "race-1"), (0.0, "race-2"), (0.5, "race-1"), (0.5, "race-2")]


@pytest.mark.slow
def test_two_workers_share_one_study_without_losing_or_repeating_trials(tiny_scenario, tmp_path):
    path = scenario_with(
        tiny_scenario,
        "{toy_sleep: {intensity: 1}}",
        "{trials: 6, references: false, sampler: random, prune: false, steps: 2, warmup_steps: 1, repeats: 1, control_every: 0}",
    )
    journal = tmp_path / "shared.log"
    result = run_cli(
        "tune",
        path,
        "--out",
        tmp_path / "tune",
        "--workers",
        "2",
        "--storage",
        f"journal:{journal}",
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    study = optuna.load_study(study_name="tiny", storage=open_storage(f"journal:{journal}"))
    assert sorted(t.number for t in study.trials) == list(range(6))
    assert all(t.state == TrialState.COMPLETE for t in study.trials)
    assert most_at_once(study.trials) == 2  # both workers ran trials, side by side
    for trial in study.trials:
        assert (
            tmp_path / "tune" / "trials" / f"{trial.number:05d}" / "run" / "summary.json"
        ).exists()


@pytest.mark.slow
def test_two_machines_share_one_study_on_postgresql(tiny_scenario, tmp_path):
    """Two `overlapkit tune` commands, each with its own folder as on two machines, on
    one study in a real PostgreSQL server: the second joins while the first runs
    (with 2 workers). Nothing is lost or run twice, and the search budget is the
    study's, not each machine's."""
    # Every trial waits at its step 1 until the gate opens: once the second machine's
    # first trial runs (the first machine, 2 workers at once, could otherwise finish
    # the study before the second started).
    gate = tmp_path / "gate"
    gate.with_suffix(".first").touch()
    path = scenario_with(
        tiny_scenario,
        f"{{toy_sleep: {{intensity: 1}}, toy_gate: {{path: '{gate}', step: 1}}}}",
        "{trials: 6, sampler: random, prune: false, policy: false, intensity_step: 1,"
        " steps: 2, warmup_steps: 1, finalists: 1, repeats: 2, search: {toy_sleep: null}}",
    )
    with throwaway_postgres() as url:
        command = [sys.executable, "-m", "overlapkit", "tune", str(path), "--storage", url]
        machines = []
        for machine, workers in (("a", "2"), ("b", "1")):
            machines.append(
                subprocess.Popen(
                    [*command, "--out", str(tmp_path / machine), "--workers", workers],
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not (tmp_path / machine / "trials").exists():
                time.sleep(0.2)  # this machine has the study and started a trial
            assert (tmp_path / machine / "trials").exists(), f"machine {machine} ran no trial"
        gate.with_suffix(".open").touch()
        for machine in machines:
            _, err = machine.communicate(timeout=600)
            assert machine.returncode == 0, err
        study = optuna.load_study(study_name="tiny", storage=open_storage(url))
        trials = study.trials
        report = run_cli("report", url, "--json", "--out", tmp_path / "report")
    assert sorted(t.number for t in trials) == list(range(len(trials)))
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    used = [t for t in trials if t.user_attrs.get("role") != "unused"]
    assert all(t.state == TrialState.COMPLETE for t in used)
    assert sum(1 for t in used if t.user_attrs["role"] == "search") == 6  # the study's budget
    # The references were queued once, by whichever machine came first.
    references = [
        t.params["toy_sleep.intensity"]
        for t in used
        if t.user_attrs["role"] in ("baseline", "alone:toy_sleep")
    ]
    assert sorted(references) == [0.0, 1.0]
    # Both machines ran trials, each in its own folder.
    machines = {Path(t.user_attrs["folder"]).parents[1].name for t in used}
    assert machines == {"a", "b"}
    for trial in used:
        assert (Path(trial.user_attrs["folder"]) / "run" / "summary.json").exists()
    # Every setting the report compares was measured at least twice (the confirm phase).
    assert report.returncode == 0, report.stderr
    rows = json.loads(report.stdout)["comparison"]
    assert all(row["measured"] >= 2 for row in rows), rows
    assert (tmp_path / "report" / "report.json").exists()  # not in the checkout's runs/


@pytest.mark.slow
def test_failed_trials_are_recorded_with_their_reason_and_the_study_goes_on(
    tiny_scenario, tmp_path
):
    out = tune_tiny(
        tiny_scenario,
        tmp_path,
        "{toy_fail: {rank: 0, step: 0}}",
        "{trials: 1, policy: false, steps: 2, warmup_steps: 1, repeats: 1, search: {toy_fail: {how: [raise, sigkill]}}}",
    )
    study = load(out)
    failed = {t.user_attrs["failure"]: t for t in study.trials if t.state == TrialState.FAIL}
    assert set(failed) == {"crashed", "killed"}
    assert "toy failure on rank 0" in failed["crashed"].user_attrs["reason"]
    assert "SIGKILL" in failed["killed"].user_attrs["reason"]
    assert any(t.state == TrialState.COMPLETE for t in study.trials)  # the baseline ran after
    assert "## Failed trials" in (out / "report.md").read_text()


@pytest.mark.slow
def test_an_interrupted_study_resumes_where_it_stopped(tiny_scenario, tmp_path):
    # The first trial runs through; the next waits at its step 1 until the gate opens,
    # and is killed there (with tune) as it waits.
    gate = tmp_path / "gate"
    path = scenario_with(
        tiny_scenario,
        f"{{toy_sleep: {{intensity: 0.5}}, toy_gate: {{path: '{gate}', step: 1}}}}",
        "{trials: 4, references: false, sampler: random, prune: false, steps: 2, warmup_steps: 1, repeats: 1, search: {toy_sleep: null}}",
    )
    out = tmp_path / "tune"
    command = [sys.executable, "-m", "overlapkit", "tune", str(path), "--out", str(out)]
    log = tmp_path / "first-tune.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=sink, stderr=sink, start_new_session=True
        )
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            time.sleep(0.1)
            if process.poll() is not None:
                pytest.fail(f"the first tune ended before it was killed:\n{log.read_text()}")
            try:
                trials = load(out).trials
            except (KeyError, OSError, sqlalchemy.exc.SQLAlchemyError):
                continue  # the study is not there yet
            states = [t.state for t in trials]
            # Killed once a trial runs under a worker that recorded itself (a trial killed
            # in the milliseconds before is an orphan only once it is old: see fail_orphans).
            running = [t for t in trials if t.state == TrialState.RUNNING and "pid" in t.user_attrs]
            if states.count(TrialState.COMPLETE) >= 1 and running:
                break
        else:
            states = {t.number: (t.state.name, sorted(t.user_attrs)) for t in load(out).trials}
            pytest.fail(f"the first tune never got one trial done: {states}\n{log.read_text()}")
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the tuner and the trial it is running
        process.wait()
    gate.with_suffix(".open").touch()
    before = {t.number: t.state for t in load(out).trials}
    done_before = [n for n, s in before.items() if s == TrialState.COMPLETE]
    result = run_cli("tune", path, "--out", out, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "already done, continuing" in result.stderr
    study = load(out)
    interrupted = [t for t in study.trials if t.user_attrs.get("failure") == "interrupted"]
    assert len(interrupted) == 1 and interrupted[0].number not in done_before
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    # The finished trials were kept, not run again; the budget of 4 was filled up.
    assert {t.number for t in complete} >= set(done_before)
    assert (
        sum(
            1
            for t in study.trials
            if t.user_attrs.get("role") == "search" and t.state != TrialState.FAIL
        )
        == 4
    )
    assert not [t for t in study.trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]


def test_trials_queued_by_a_stopped_run_run_first_under_their_own_heading(tiny_scenario, tmp_path):
    """A tune stopped in a queued phase (confirm, analysis) leaves its queue: the next
    run ran those trials under the first phase's heading ('references'), and with no
    references and the search done, never ran them."""
    tune = "{trials: 1, references: false, sampler: random, prune: false, steps: 2, warmup_steps: 1, repeats: 1}"
    out = tune_tiny(tiny_scenario, tmp_path, "{toy_sleep: {intensity: 0.5}}", tune)
    study = load(out)
    enqueue(study, [("repeat", study.trials[0].params)], again=True)
    result = run_cli(
        "tune",
        scenario_with(tiny_scenario, "{toy_sleep: {intensity: 0.5}}", tune),
        "--out",
        out,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "queued earlier: 1 trial on 1 worker(s)" in result.stderr
    repeat = [t for t in load(out).trials if t.user_attrs.get("role") == "repeat"]
    assert [t.state for t in repeat] == [TrialState.COMPLETE]


def test_a_trial_whose_worker_died_before_recording_itself_is_an_orphan_once_old(monkeypatch):
    from overlapkit.tuning import study as study_module

    optuna_study = optuna.create_study()
    optuna_study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})  # RUNNING, no pid
    assert study_module.fail_orphans(optuna_study) == []  # it may be starting right now
    monkeypatch.setattr(study_module, "UNCLAIMED_ORPHAN_S", 0)
    assert study_module.fail_orphans(optuna_study) == [0]
    assert optuna_study.trials[0].user_attrs["failure"] == "interrupted"


def test_the_live_step_log_is_read_a_complete_line_at_a_time(tmp_path):
    from overlapkit.runtime.report import LiveSteps

    path = tmp_path / "live-steps.jsonl"
    assert LiveSteps.read_new(path, 0) == ("", 0)  # not written yet
    path.write_text('{"step": 0}\n{"step": 1')  # the second line is half written
    text, offset = LiveSteps.read_new(path, 0)
    assert text == '{"step": 0}\n' and offset == len(text)
    with path.open("a") as f:
        f.write("}\n")
    assert LiveSteps.read_new(path, offset) == ('{"step": 1}\n', offset + len('{"step": 1}\n'))


def test_a_trial_line_fits_80_columns_and_keeps_the_whole_setting():
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    from overlapkit.tuning.runner import _lines
    from overlapkit.tuning.space import short_setting

    params = {
        "ddp_overlap.intensity": 0.5,
        "prefetch.intensity": 0.5,
        "checkpoint.every": 8,
        "scheduler.policy": "partition",
        "scheduler.background_nice": 19,
    }
    distributions = {
        name: CategoricalDistribution([value])
        if isinstance(value, str)
        else FloatDistribution(0, 64)
        for name, value in params.items()
    }
    done = optuna.trial.create_trial(
        params=params,
        distributions=distributions,
        value=977.1,
        user_attrs={"role": "pair:ddp_overlap+checkpoint", "throughput": 977.1, "goodput": 960.5},
    )
    short = optuna.trial.create_trial(
        params={"prefetch.intensity": 1.0},
        distributions={"prefetch.intensity": FloatDistribution(0, 1)},
        value=900.0,
        user_attrs={"role": "search", "throughput": 900.0, "goodput": 890.0},
    )
    long_lines = _lines(done, 80).splitlines()
    assert len(long_lines) > 1 and all(len(line) <= 80 for line in long_lines)
    assert "977.1 samples/s" in long_lines[0] and "pair:ddp_overlap+checkpoint" in long_lines[0]
    assert " ".join(" ".join(long_lines[1:]).split()) == short_setting(params)
    assert _lines(short, 80) == (
        "trial   -1    900.0 samples/s  goodput    890.0  search  prefetch 1"
    )  # one line where it fits
    # A killed trial says what killed it (it said the run's last line: "killed: overlapkit:
    # run folder ...").
    for kind, reason, said in (
        ("killed", "killed by SIGKILL (out of memory?)\noverlapkit: run folder /x/run", "SIGKILL"),
        ("crashed", "exit status 1\nRuntimeError: shapes do not match", "Runtime"),
    ):
        failed = optuna.trial.create_trial(
            params={"prefetch.intensity": 1.0},
            distributions={"prefetch.intensity": FloatDistribution(0, 1)},
            state=optuna.trial.TrialState.FAIL,
            user_attrs={"role": "baseline", "failure": kind, "reason": reason},
        )
        first = _lines(failed, 80).splitlines()[0]
        assert said in first and "baseline" in first
        assert f"failed ({kind}: " in first or "failed (killed by SIGKILL" in first
        assert len(first) <= 80, first


def _open_at_once(url, barrier, results):
    from overlapkit.tuning.study import open_storage

    barrier.wait()
    try:
        open_storage(url)
        results.put("ok")
    except Exception as error:  # noqa: BLE001 - the test counts them
        results.put(f"{type(error).__name__}: {str(error)[:200]}")


def test_processes_opening_a_new_storage_at_once_all_open_it(tmp_path):
    """A tune driver and something reading its new study.db at the same moment (a
    dashboard, a test's poll, workers on other machines) raced to create its tables:
    the loser ended in IntegrityError ('UNIQUE constraint failed: alembic_version'),
    seen in CI as a driver's internal error."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    outcomes = []
    for round_ in range(6):
        url = f"sqlite:///{tmp_path / f'study{round_}.db'}"
        barrier, results = context.Barrier(4), context.Queue()
        processes = [
            context.Process(target=_open_at_once, args=(url, barrier, results)) for _ in range(4)
        ]
        for process in processes:
            process.start()
        outcomes += [results.get(timeout=120) for _ in processes]
        for process in processes:
            process.join(timeout=60)
    assert set(outcomes) == {"ok"}, outcomes


def test_tune_commands_and_threads_taking_queued_trials_at_once_never_take_the_same_one(
    tmp_path,
):
    """tune's workers are threads: each takes a queued trial by setting it running
    where it still waits, under a row lock SQLite does not have. Four threads taking
    60 queued trials at once took 21 to 30 of them twice (a trial run twice found its
    folder in use by the other); two tune commands on one SQLite file, 5 to 11. Here
    two processes (as two tune commands) of two threads each."""
    import collections
    import multiprocessing

    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="s", storage=open_storage(url))
    for x in range(60):
        study.enqueue_trial({"x": x})
    together = multiprocessing.get_context("fork").Barrier(4)

    def take(numbers: list[int]) -> None:
        mine = optuna.load_study(study_name="s", storage=open_storage(url))  # as a worker
        together.wait(timeout=60)
        while (trial := mine.ask()).number < 60:  # queued ones first, then new ones
            numbers.append(trial.number)

    def two_threads() -> list[int]:
        numbers: list[int] = []
        threads = [threading.Thread(target=take, args=(numbers,)) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        return numbers

    child_took = tmp_path / "child"
    if (pid := os.fork()) == 0:  # the other tune command
        try:
            child_took.write_text(json.dumps(two_threads()))
        finally:
            os._exit(0)
    here = two_threads()
    os.waitpid(pid, 0)
    taken = collections.Counter(here + json.loads(child_took.read_text()))
    assert sorted(taken) == list(range(60))
    assert not {n: times for n, times in taken.items() if times > 1}


def budget_of_one(tmp_path: Path) -> tuple[TuneJob, optuna.Study]:
    """A tune job whose search budget is one trial, and its new study."""
    base = {**yaml.safe_load(TINY_SCENARIO), "optimizations": {"checkpoint": {}}}
    job = TuneJob(base, TuneConfig(trials=1), tmp_path, default_storage(tmp_path), "tiny")
    return job, optuna.create_study(study_name="tiny", storage=open_storage(job.storage_url))


def once_the_study_holds(study: optuna.Study, trials: int, then: Callable[[], None]):
    """Calls ``then()`` from a thread once ``study`` holds ``trials`` trials (another
    machine's trial was made, and waits on the earlier ones); returns the thread."""

    def wait_then() -> None:
        deadline = time.monotonic() + 60
        while len(study.get_trials(deepcopy=False)) < trials and time.monotonic() < deadline:
            time.sleep(0.01)
        then()

    thread = threading.Thread(target=wait_then, daemon=True)
    thread.start()
    return thread


def machine_b_starts_a_search_trial(job: TuneJob) -> FrozenTrial:
    """Another machine's worker starts one trial of the study, which must not run."""

    def refuse(*_):
        raise AssertionError("a second search trial ran in a budget of one")

    machine_b = optuna.load_study(study_name="tiny", storage=open_storage(job.storage_url))
    ended: list[FrozenTrial] = []
    machine_b.optimize(
        Objective(job, runner=refuse), n_trials=1, callbacks=[lambda _, t: ended.append(t)]
    )
    return ended[0]


def test_two_machines_starting_trials_at_once_never_both_take_the_last_search_place(
    tmp_path,
):
    """Each trial counts the search trials numbered before it; one made a moment
    earlier elsewhere had not said its role yet and counted as nothing, so both ran:
    7 search trials in a study of 6 (CI, two machines on PostgreSQL)."""
    job, study = budget_of_one(tmp_path)
    first = study.ask()  # machine A's trial: made, its role not said yet
    says = once_the_study_holds(study, 2, lambda: first.set_user_attr("role", "search"))
    second = machine_b_starts_a_search_trial(job)  # its trial 1, made at once
    says.join(timeout=60)
    assert (second.state, second.user_attrs["role"]) == (TrialState.PRUNED, "unused")


def test_a_setting_queued_again_holds_its_trials_place_in_the_search_budget(tmp_path):
    """A trial lost with its machine is not counted (its setting runs again), and the
    setting queued again was not counted either while it waited: a trial another
    machine started meanwhile ran too, one search trial beyond the budget. The copy
    itself runs in the place it holds."""
    job, study = budget_of_one(tmp_path)
    lost = study.ask()  # machine A's only search trial: its machine is lost
    for key, value in {"role": "search", "failure": "node_lost", "queued_again": True}.items():
        lost.set_user_attr(key, value)
    study.tell(lost, state=TrialState.FAIL)
    other = study.ask()  # a trial of machine A that says its role a moment later

    def queue_the_lost_setting_again() -> None:
        attrs = {"role": "search", "retry": True, "again_of": lost.number}
        study.enqueue_trial(lost.params, user_attrs=attrs)
        other.set_user_attr("role", "unused")

    later = once_the_study_holds(study, 3, queue_the_lost_setting_again)
    second = machine_b_starts_a_search_trial(job)  # its trial 2, waiting on `other`
    later.join(timeout=60)
    assert (second.state, second.user_attrs["role"]) == (TrialState.PRUNED, "unused")
    assert study.trials[3].state == TrialState.WAITING  # the lost setting, still to run

    def ran(*_):
        raise TrialFailed("crashed", "it ran")

    study.optimize(Objective(job, runner=ran), n_trials=1, catch=(TrialFailed,))
    assert study.trials[3].user_attrs["failure"] == "crashed"  # it ran, in its place


def test_a_trial_whose_worker_stopped_beating_runs_again_once_and_counts_once(tmp_path):
    """Optuna fails a running trial whose worker stopped beating (its machine died) and
    retried it with a copy of every attribute: the failed trial still counted against
    the search budget, and so did its copy. A trial that had no setting yet is not
    run again (its copy would sample a new one outside the budget), and a setting is
    never queued twice (its worker queued it as it stopped, another found it gone)."""
    storage = open_storage(f"sqlite:///{tmp_path / 'study.db'}")
    storage.grace_period = 0  # stale once a second passed
    study = optuna.create_study(study_name="s", storage=storage)
    study.enqueue_trial({"x": 0.25}, user_attrs={"role": "repeat"})
    taken = study.ask()  # its worker died as it took this queued setting
    x = {"x": optuna.distributions.FloatDistribution(0, 1)}
    lost, unset = study.ask(x), study.ask()
    for key, value in {"role": "search", "host": "gone", "pid": 1, "folder": "t"}.items():
        lost.set_user_attr(key, value)
    unset.set_user_attr("role", "search")  # its worker died as it waited on the budget
    for trial in (taken, lost, unset):
        storage.record_heartbeat(trial._trial_id)
    time.sleep(1.1)
    optuna.storages.fail_stale_trials(study)  # as any worker does before its next trial
    first = study.trials[lost.number]
    assert first.state == TrialState.FAIL and first.user_attrs["failure"] == "interrupted"
    assert "no heartbeat" in first.user_attrs["reason"]
    assert "before it ran" in study.trials[unset.number].user_attrs["reason"]
    queue_again(study, lost, lost.params)  # its worker, late
    copies = {t.user_attrs["again_of"]: t for t in study.get_trials(states=(TrialState.WAITING,))}
    assert sorted(copies) == [taken.number, lost.number]  # the one with no setting: not
    assert copies[taken.number].system_attrs["fixed_params"] == {"x": 0.25}
    assert copies[taken.number].user_attrs["role"] == "repeat"
    study.tell(study.ask(), state=TrialState.FAIL)  # the repeat's copy, out of the way
    again = copies[lost.number]
    assert again.system_attrs["fixed_params"] == first.params
    assert again.user_attrs == {"role": "search", "again_of": lost.number, "retry": True}
    assert search_done(study) == 0  # the setting counts once, when it runs again
    # Its worker stops beating again: failed for good, and it counts.
    retried = study.ask()
    assert retried.number == again.number
    retried.set_user_attr("folder", "t2")
    storage.record_heartbeat(retried._trial_id)
    time.sleep(1.1)
    optuna.storages.fail_stale_trials(study)
    assert study.trials[retried.number].user_attrs["failure"] == "lost"
    assert not study.get_trials(states=(TrialState.WAITING,))
    assert search_done(study) == 1


def test_a_setting_queued_twice_from_two_machines_runs_once(tmp_path):
    """Two machines finding one trial's worker gone at once each queue its setting
    (PostgreSQL takes no lock for that): the copy taken second is dropped."""
    base = {**yaml.safe_load(TINY_SCENARIO), "optimizations": {"checkpoint": {}}}
    job = TuneJob(base, TuneConfig(trials=4), tmp_path, default_storage(tmp_path), "tiny")
    study = optuna.create_study(study_name="tiny", storage=open_storage(job.storage_url))
    lost = study.ask()
    study.tell(lost, state=TrialState.FAIL)
    for _ in range(2):
        study.enqueue_trial({}, user_attrs={"role": "search", "again_of": lost.number})
    ran = []

    def run(*_):
        ran.append(1)
        raise TrialFailed("crashed", "it ran")

    study.optimize(Objective(job, queued=True, runner=run), n_trials=2, catch=(TrialFailed,))
    assert len(ran) == 1
    assert study.trials[2].user_attrs["role"] == "unused"


@pytest.mark.parametrize("ends", ["measured", "failed"])
def test_a_trial_taken_for_lost_while_its_worker_ran_on_does_not_stop_tune(tmp_path, ends):
    """A worker whose heartbeat was late (its machine paused, the database out of
    reach for a minute) had its trial failed by another machine, which queued the
    setting again. When the trial then ended here, Optuna refused to record it
    ("Cannot tell a FAIL trial") and tune stopped with that error."""
    base = {**yaml.safe_load(TINY_SCENARIO), "optimizations": {"checkpoint": {}}}
    job = TuneJob(base, TuneConfig(trials=4), tmp_path, default_storage(tmp_path), "tiny")
    ran: list[dict] = []

    def run(data, folder, *_):
        ran.append(data)
        if len(ran) == 1:  # another machine finds this trial's heartbeat late
            elsewhere = open_storage(job.storage_url)
            elsewhere.grace_period = 0  # stale once a second passed
            time.sleep(1.1)
            optuna.storages.fail_stale_trials(
                optuna.load_study(study_name="tiny", storage=elsewhere)
            )
            if ends == "measured":
                return {}  # its summary: never read, the trial being taken
        raise TrialFailed("crashed", "it ran")

    with pytest.warns(TrialTakenWarning, match=r"trial 0 ended here .* runs again as trial 1"):
        worker_main(job, 2, None, runner=run)
    study = optuna.load_study(study_name="tiny", storage=open_storage(job.storage_url))
    first, again = study.trials
    assert first.user_attrs["failure"] == "interrupted", first.user_attrs
    assert again.user_attrs["again_of"] == 0 and again.user_attrs["failure"] == "crashed"
    assert ran[1] == ran[0]  # its setting, run again


def test_a_phase_runs_the_setting_a_lost_machine_left_while_it_ran(tmp_path):
    """A machine lost while a phase ran here: its trial's setting is queued again
    when a worker finds its heartbeat late, in the middle of the phase's round. The
    phase must run another round for it, or it waits in the queue while the study
    goes on without it."""
    from rich.console import Console

    from overlapkit.tuning.runner import Pool, Shown, _phase

    base = {**yaml.safe_load(TINY_SCENARIO), "optimizations": {"checkpoint": {}}}
    job = TuneJob(base, TuneConfig(trials=4), tmp_path, default_storage(tmp_path), "tiny")
    study = open_study(job, queued=True)
    lost = study.ask()  # machine B's search trial, running as its machine went
    params = job.space.suggest(lost)
    for key, value in {"role": "search", "host": "b", "pid": 1, "folder": "t"}.items():
        lost.set_user_attr(key, value)
    study._storage.record_heartbeat(lost._trial_id)
    with sqlalchemy.create_engine(job.storage_url).begin() as db:  # its last beat, long ago
        db.execute(sqlalchemy.text("UPDATE trial_heartbeats SET heartbeat = '2000-01-01'"))
    study.enqueue_trial(params, user_attrs={"role": "repeat"})  # this phase's one trial
    console = Console(file=io.StringIO(), width=120)
    _phase("queued", job, study, lambda: waiting(study), Pool(), None, Shown(set(), console))
    trials = study.get_trials(deepcopy=False)
    assert [t.user_attrs.get("again_of") for t in trials] == [None, None, lost.number]
    assert trials[0].user_attrs["failure"] == "interrupted"
    assert [t.state for t in trials[1:]] == [TrialState.COMPLETE] * 2, console.file.getvalue()


def test_a_report_of_a_study_tuned_with_a_plugin_not_loaded_here_is_one_line(tmp_path):
    """`overlapkit report` of a study whose scenario searched a plugin's optimization,
    in a shell without the plugin: an internal error and a traceback file."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="s", storage=open_storage(url))
    study.set_user_attr("tune", TuneConfig().model_dump())
    study.set_user_attr("scenario", {"optimizations": {"their_overlap": {"intensity": 1}}})
    result = cli_here("report", url, "--out", tmp_path / "report")
    assert result.returncode == 2, result.stderr
    assert "unknown optimization 'their_overlap'" in result.stderr
    assert "load that plugin as tune did (its module in OVERLAPKIT_PLUGINS" in result.stderr


def test_a_failed_trials_reason_is_cut_at_a_word_not_mid_word():
    """'failed (invalid: error: ddp_overlap needs at least 2 replicas of each pipelin)':
    the reason was cut at 60 characters, mid-word."""
    from optuna.distributions import FloatDistribution
    from optuna.trial import TrialState

    from overlapkit.tuning.runner import _lines

    reason = (
        "error: ddp_overlap needs at least 2 replicas of each pipeline stage; 2 ranks "
        "make 1 (add ranks, or leave ddp_overlap out)"
    )
    failed = optuna.trial.create_trial(
        params={"pipeline.intensity": 1.0},
        distributions={"pipeline.intensity": FloatDistribution(0, 1)},
        state=TrialState.FAIL,
        user_attrs={"role": "search", "failure": "invalid", "reason": reason},
    )
    line = _lines(failed, 80).splitlines()[0]
    assert "each pipeline stage;" in line and "pipelin)" not in line
    assert line.split("(", 1)[1].startswith("invalid: error: ddp_overlap") and " ...)" in line
