"""Does tuning find where overlap stops paying? A scenario built to contend on a
2-core machine: 2-rank DDP (gloo), an input pipeline that costs 0.5 ms per
sample with loader workers, and checkpoints persisted every few steps.

Two studies in one run, over the same space (ddp_overlap and prefetch
intensities 0 / 0.5 / 1, checkpoint on/off x every 2 or 8 steps, policy free or
priority), by goodput (MTBF 1 h, a 4 h job, 30 s restart):
  * tuned: the reference trials, 12 TPE trials and the analysis trials;
  * grid: every point of the grid.
Then the tuned best, the grid best, the naive all-on and the best single
optimization are measured again side by side (3 rounds, rotating order, medians).

    python benchmarks/tune.py [--out runs/bench-tune] [--keep]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from overlapkit.tuning import TuneConfig
from overlapkit.tuning.report import print_report, report_document, write_report
from overlapkit.tuning.runner import tune
from overlapkit.tuning.space import apply_params
from overlapkit.tuning.study import TuneJob, default_storage, trial_metrics
from overlapkit.tuning.trial import run_trial, trial_scenario

SCENARIO = yaml.safe_load(
    """
name: contend
model: {name: resnet18, stem: cifar, num_classes: 10, width: 8}
data: {name: synthetic-images, shape: [3, 32, 32], num_samples: 4096, sample_cost_ms: 0.5}
train: {batch_size: 16, steps: 10, warmup_steps: 3, optimizer: {name: sgd, lr: 0.05, momentum: 0.9}}
world: {nprocs: 2}
optimizations:
  ddp_overlap: {}
  prefetch: {backend: torch}
  checkpoint: {every: 2}
"""
)
TUNE = dict(
    objective="goodput",
    mtbf_hours=1.0,
    job_hours=4.0,
    restart_s=30.0,
    intensity_step=0.5,
    steps=10,
    warmup_steps=3,
    search={
        "ddp_overlap": ["intensity"],
        "prefetch": ["intensity"],
        "checkpoint": {"every": [2, 8]},
    },
)
ROUNDS = 3


def study(folder: Path, name: str, **overrides) -> tuple[TuneJob, object]:
    config = TuneConfig(**{**TUNE, **overrides})
    job = TuneJob(SCENARIO, config, folder, default_storage(folder), name)
    analysis = tune(job, console=Console(stderr=True))
    return job, analysis


def remeasure(job: TuneJob, settings: dict[str, dict], scratch: Path) -> dict[str, float]:
    values: dict[str, list[float]] = {label: [] for label in settings}
    labels = list(settings)
    for round_ in range(ROUNDS):
        for label in labels[round_ % len(labels) :] + labels[: round_ % len(labels)]:
            data = trial_scenario(apply_params(SCENARIO, job.space, settings[label]), 10, 3)
            summary = run_trial(data, scratch / f"{label}-{round_}", 600)
            values[label].append(trial_metrics(summary, job.tune)["goodput"])
            shutil.rmtree(scratch / f"{label}-{round_}", ignore_errors=True)
    return {label: statistics.median(v) for label, v in values.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="keep both studies here")
    parser.add_argument("--plot", type=Path, default=Path("docs/tune-contention.png"))
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="bench-tune-"))
    console = Console()
    try:
        tuned_job, tuned = study(root / "tuned", "tuned", trials=12)
        grid_job, grid = study(
            root / "grid", "grid", sampler="grid", references=False, prune=False, trials=10_000
        )
        document = report_document(tuned)
        files = write_report(tuned, document, SCENARIO, root / "tuned")
        print_report(document, files, console)
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(files["contention_plot"], args.plot)

        rows = {row["row"]: row for row in tuned.comparison()}
        singles = [r for r in rows.values() if r["row"].endswith(" alone") and r["goodput"]]
        best_single = max(singles, key=lambda r: r["goodput"])
        single_name = best_single["row"].removesuffix(" alone")
        alone = tuned.alone_best()
        settings = {
            "naive all on": tuned.space.setting(
                {"scheduler.policy": "free"}, **{n: "max" for n in tuned.space.optimizations}
            ),
            f"best single ({single_name})": tuned.space.setting(
                {"scheduler.policy": "free"}, **{single_name: alone[single_name]}
            ),
            "tuned best": tuned.best.params,
            "grid best": grid.best.params,
        }
        again = remeasure(tuned_job, settings, root / "remeasure")
        n_tuned = len(tuned.study.trials)
        n_grid = len(grid.study.trials)
        table = Table(
            title="tune on 2 cores: 2-rank DDP + prefetch workers + checkpoints (goodput, samples/s)"
        )
        for column in (
            "setting",
            "in its study",
            f"re-measured (median of {ROUNDS})",
            "vs naive",
            "trials",
            "knobs",
        ):
            table.add_column(column, justify="left" if column in ("setting", "knobs") else "right")
        in_study = {
            "naive all on": rows["all on, full (naive)"]["goodput"],
            f"best single ({single_name})": best_single["goodput"],
            "tuned best": tuned.best.goodput,
            "grid best": grid.best.goodput,
        }
        counts = {"tuned best": str(n_tuned), "grid best": str(n_grid)}
        for label, params in settings.items():
            table.add_row(
                label,
                f"{in_study[label]:.1f}",
                f"{again[label]:.1f}",
                f"{again[label] / again['naive all on']:.2f}x",
                counts.get(label, ""),
                ", ".join(f"{k}={v}" for k, v in params.items()),
            )
        console.print(table)
        console.print(
            f"tuned: {n_tuned} trials ({sum(1 for m in tuned.measured if m.role == 'search')} by TPE); "
            f"grid: {n_grid} trials (grid of {grid_job.space.grid_size()}); "
            f"tuned best / grid best re-measured: {again['tuned best'] / again['grid best']:.2f}"
        )
    finally:
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
