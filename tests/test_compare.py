"""report --compare: two studies of one scenario "on different hardware", built with
the tuner's own phases (references, search, analysis around the best) in real Optuna
storages, their trials' throughput a known function of the knobs."""

from __future__ import annotations

import json

import optuna
import pytest
import yaml

from conftest import TINY_SCENARIO, cli_here
from overlapkit.runtime.hardware import hardware_label
from overlapkit.tuning.analysis import Analysis
from overlapkit.tuning.config import TuneConfig
from overlapkit.tuning.phases import analysis_settings, enqueue, reference_settings
from overlapkit.tuning.study import TuneJob, default_storage, open_study, waiting

OPTIMIZATIONS = {"ddp_overlap": {"intensity": 1}, "toy_sleep": {"intensity": 1}}


def build_study(folder, hardware: str, ddp_peak: float):
    """Throughput rises with ddp_overlap's intensity up to ``ddp_peak``, then falls;
    toy_sleep only costs."""
    base = yaml.safe_load(TINY_SCENARIO)
    base["optimizations"] = OPTIMIZATIONS
    config = TuneConfig(trials=6, references=True, repeats=1, sampler="random", prune=False)
    job = TuneJob(base, config, folder, default_storage(folder), "tiny")
    job.save()
    study = open_study(job)
    space = job.space

    def throughput(params):
        ddp = params.get("ddp_overlap.intensity", 0.0) if params.get("ddp_overlap.on", True) else 0
        sleep = params.get("toy_sleep.intensity", 0.0) if params.get("toy_sleep.on", True) else 0
        return (
            100
            * (1 + ddp if ddp <= ddp_peak else 1 + ddp_peak - 2 * (ddp - ddp_peak))
            * (1 - 0.5 * sleep)
        )

    def run(trial_count=None):
        done = 0
        while waiting(study) if trial_count is None else done < trial_count:
            trial = study.ask()
            params = space.suggest(trial)
            trial.set_user_attr("role", trial.user_attrs.get("role", "search"))
            value = throughput(params)
            for key, attr in {"throughput": value, "goodput": value, "hardware": hardware}.items():
                trial.set_user_attr(key, attr)
            study.tell(trial, value)
            done += 1

    enqueue(study, reference_settings(space))
    run()
    run(6)
    analysis = Analysis.of(study, space)
    enqueue(study, analysis_settings(space, analysis.center.params, analysis.alone_best()))
    run()
    return folder


def test_two_studies_side_by_side_show_both_hardware_and_where_overlap_stops(tmp_path):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    small = build_study(tmp_path / "small", "1 machine, 2 cores CPU A each; torch 2.13", 0.5)
    large = build_study(tmp_path / "large", "2 machines, 4 x V100 (sm 7.0) each; torch 2.13", 1.0)
    out = tmp_path / "compare"
    result = cli_here("report", "--compare", small, large, "--out", out, "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document == json.loads((out / "compare.json").read_text())
    by_hardware = {s["hardware"]: s for s in document["studies"]}
    assert set(by_hardware) == {
        "1 machine, 2 cores CPU A each; torch 2.13",
        "2 machines, 4 x V100 (sm 7.0) each; torch 2.13",
    }
    small_doc = by_hardware["1 machine, 2 cores CPU A each; torch 2.13"]
    large_doc = by_hardware["2 machines, 4 x V100 (sm 7.0) each; torch 2.13"]
    # Where ddp_overlap stops paying moved with the hardware.
    assert small_doc["contention_points"]["ddp_overlap"] == 0.5
    # On the larger machines it still paid at 1.0, the top of the range searched.
    assert large_doc["contention_points"]["ddp_overlap"] == "not in the range: best at its top, 1.0"
    assert small_doc["best"]["params"]["ddp_overlap.intensity"] == 0.5
    # Naive (everything at full) against tuned: tuning gains more where overlap stops
    # paying earlier (6x against 2x by the formula above).
    assert small_doc["tuned_vs_naive"] == pytest.approx(6.0)
    assert large_doc["tuned_vs_naive"] == pytest.approx(2.0)
    # The people's version: a table with both, the markdown and a plot.
    table = cli_here("report", "--compare", small, large, "--out", out)
    assert table.returncode == 0, table.stderr
    text = " ".join(table.stdout.split())
    assert "V100" in text and "CPU A" in text and "contention point" in text
    assert (out / "compare.png").stat().st_size > 10_000
    markdown = (out / "compare.md").read_text()
    assert "| | tiny (small) | tiny (large) |" in markdown  # one name, told apart
    assert (
        "| ddp_overlap: contention point | 0.5 | not in the range: best at its top, 1.0 |"
        in markdown
    )


def test_compare_needs_two_studies_and_says_so(tmp_path):
    result = cli_here("report", "--compare", tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr


def test_the_hardware_line_names_machines_gpus_and_versions():
    gpu_node = {
        "host": "a", "cpu_model": "Xeon", "cpu_cores": 8, "torch": "2.13.0", "cuda": "12.6",
        "nccl": "2.27.3", "gpus": ["Tesla V100-SXM2-16GB"] * 4, "gpu_capability": "7.0",
    }  # fmt: skip
    label = hardware_label({"nodes": [gpu_node, {**gpu_node, "host": "b", "node_type": "x"}]})
    assert label == (
        "2 machines, 4 x Tesla V100-SXM2-16GB (sm 7.0) each; torch 2.13.0, CUDA 12.6, NCCL 2.27.3"
    )
    cpu = {"host": "a", "cpu_model": "AMD EPYC", "cpu_cores": 2, "torch": "2.13.0", "gpus": []}
    assert hardware_label({"nodes": [cpu]}) == "1 machine, 2 cores AMD EPYC each; torch 2.13.0"
    typed = {"nodes": [{**cpu, "node_type": "gpu_4x_v100"}]}
    assert hardware_label(typed).startswith("1 machine (gpu_4x_v100), 2 cores")
    assert hardware_label(None) == "unknown hardware"


def test_the_plot_puts_every_study_s_levels_in_order_and_names_mixed_metrics(tmp_path, monkeypatch):
    """Levels drawn as text went in the order first drawn: a second study's 0.25 and
    0.75 after the first's 1.0, its curve zigzagging; and a goodput study was labelled
    with the first study's throughput."""
    from overlapkit.tuning import compare

    figures = []
    monkeypatch.setattr(compare, "save_figure", lambda fig, path: figures.append(fig) or path)
    studies = [
        {"label": "coarse", "hardware": "A", "metric": "throughput",
         "curves": {"ddp_overlap": [(0.0, 10.0), (0.5, 20.0), (1.0, 15.0)]}},
        {"label": "fine", "hardware": "B", "metric": "goodput",
         "curves": {"ddp_overlap": [(0.0, 1.0), (0.25, 2.0), (0.5, 3.0), (0.75, 4.0), (1.0, 5.0)]}},
    ]  # fmt: skip
    compare._plot({"studies": studies, "optimizations": ["ddp_overlap"]}, tmp_path / "c.png")
    ax = figures[0].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.0", "0.25", "0.5", "0.75", "1.0"]
    coarse, fine = ax.get_lines()
    assert list(coarse.get_xdata()) == [0, 2, 4] and list(fine.get_xdata()) == [0, 1, 2, 3, 4]
    assert ax.get_ylabel() == "each study's metric, share of the study's peak"
    assert fine.get_label().startswith("fine (goodput)")


def test_the_markdown_names_each_studys_metric_when_they_differ():
    """compare.md gave a goodput study's best under 'best' beside a throughput study's,
    unlabelled (the terminal's table named them), and the terminal appended the
    metric to 'not measured'."""
    from overlapkit.tuning import compare

    def study(label, metric, naive):
        return {
            "label": label, "hardware": "cpu", "trials": 3, "metric": metric, "naive": naive,
            "best": {"value": 12.0, "params": {"ddp_overlap.intensity": 0.5}},
            "tuned_vs_naive": None, "tuned_vs_baseline": None, "contention_points": {},
        }  # fmt: skip

    document = {"studies": [study("a", "throughput", 10.0), study("b", "goodput", None)]}
    document["optimizations"] = []
    text = compare._markdown(document, plot=False)
    assert "| best (each study's metric) | 12.0 throughput | 12.0 goodput |" in text
    assert "| naive (all at full) | 10.0 throughput | not measured |" in text
