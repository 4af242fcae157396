"""Does tuning find where overlap stops paying? The scenario of
scenarios/tune-contend.yaml, built to contend on a 2-core machine: 2-rank DDP
(gloo), an input pipeline that decodes on a core (0.5 ms of CPU per sample)
with loader workers, and checkpoints persisted every few steps.

Two studies in one run, over the same space (ddp_overlap and prefetch
intensities 0 / 0.5 / 1, checkpoint on/off x every 2 or 8 steps, policy free,
priority or partition, partition's background_nice 0 or 19), by goodput (MTBF
1 h, a 4 h job, 30 s restart), each with its confirm phase (the 3 best settings
and the reference rows measured 3 times):
  * tuned: the reference trials, --trials TPE trials (default 24), the confirm
    and analysis trials (the analysis settings measured 3 times too);
  * grid: every point of the grid, then its confirm trials (--no-grid skips it:
    216 points).
Then the tuned best, the grid best, the naive all-on and the best single
optimization are measured again side by side (5 rounds, rotating order, medians).

    python benchmarks/tune.py [--out runs/bench-tune] [--trials 24] [--no-grid]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import yaml
from _cli import description, positive_int
from rich.console import Console
from rich.table import Table

from overlapkit.tuning import TuneConfig
from overlapkit.tuning.analysis import ANALYSIS_ROLES, Analysis
from overlapkit.tuning.report import print_report, report_document, write_report
from overlapkit.tuning.runner import tune
from overlapkit.tuning.space import apply_params, short_setting
from overlapkit.tuning.study import TuneJob, default_storage, trial_metrics
from overlapkit.tuning.trial import run_trial, trial_scenario

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = yaml.safe_load((ROOT / "scenarios" / "tune-contend.yaml").read_text())
TUNE = SCENARIO.pop("tune")
ROUNDS = 5


def study(folder: Path, name: str, **overrides) -> tuple[TuneJob, Analysis]:
    config = TuneConfig(**{**TUNE, **overrides})
    job = TuneJob(SCENARIO, config, folder, default_storage(folder), name)
    return job, tune(job, console=Console(stderr=True))


def remeasure(job: TuneJob, settings: dict[str, dict], scratch: Path) -> dict[str, list[float]]:
    """Each setting's goodput, ``ROUNDS`` times, each round in a rotated order."""
    values: dict[str, list[float]] = {label: [] for label in settings}
    labels = list(settings)
    for round_ in range(ROUNDS):
        for label in labels[round_ % len(labels) :] + labels[: round_ % len(labels)]:
            folder = scratch / f"{round_}-{len(values[label])}-{label.split()[0]}"
            data = trial_scenario(
                apply_params(SCENARIO, job.space, settings[label]),
                job.tune.steps,
                job.tune.warmup_steps,
            )
            summary = run_trial(data, folder, job.tune.trial_timeout_s)
            values[label].append(trial_metrics(summary, job.tune)["goodput"])
            shutil.rmtree(folder, ignore_errors=True)
    return values


def trials_to_find(analysis: Analysis) -> int:
    """Trials run before the best was known: all but the analysis phase's, unless
    the analysis phase found (and confirmed) the best."""
    if analysis.best.params != analysis.center.params:
        return len(analysis.study.trials)
    return sum(
        1
        for t in analysis.study.trials
        if not t.user_attrs.get("role", "search").startswith(ANALYSIS_ROLES)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--out", type=Path, help="keep both studies here")
    parser.add_argument(
        "--plot",
        type=Path,
        default=ROOT / "docs" / "tune-contention.png",
        help="the contention plot, with tune-overview.png beside it (default: the README's "
        "docs/tune-contention.png and docs/tune-overview.png, overwritten)",
    )
    parser.add_argument(
        "--trials", type=positive_int, default=24, help="the tuned study's TPE trials"
    )
    parser.add_argument(
        "--no-grid", action="store_true", help="skip the exhaustive grid study (the longest part)"
    )
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="bench-tune-"))
    console = Console(width=200)
    try:
        tuned_job, tuned = study(root / "tuned", "tuned", trials=args.trials)
        grid_job = grid = None
        if not args.no_grid:
            grid_job, grid = study(
                root / "grid", "grid", sampler="grid", references=False, prune=False, trials=10_000
            )
        document = report_document(tuned)
        files = write_report(tuned, document, SCENARIO, root / "tuned")
        print_report(document, files, console)
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(files["contention_plot"], args.plot)
        shutil.copy(files["overview_plot"], args.plot.with_name("tune-overview.png"))

        rows = {row["row"]: row for row in document["comparison"]}
        singles = [r for r in rows.values() if r["row"].endswith(" alone") and r["goodput"]]
        best_single = max(singles, key=lambda r: r["goodput"])
        single_name = best_single["row"].removesuffix(" alone")
        free = {"scheduler.policy": "free"}
        space = tuned.space
        settings = {
            "naive all on": space.setting(free, **{n: "max" for n in space.optimizations}),
            f"best single ({single_name})": space.setting(
                free, **{single_name: tuned.alone_best()[single_name]}
            ),
            "tuned best": tuned.best.params,
        }
        if grid is not None:
            settings["grid best"] = grid.best.params
        in_study = {
            "naive all on": rows["all on, full (naive)"],
            f"best single ({single_name})": best_single,
            "tuned best": rows["tuned best"],
        }
        if grid is not None:
            in_study["grid best"] = {
                "goodput": grid.best.goodput,
                "measured": len(grid.measurements(grid.best.params)),
            }
        again = remeasure(tuned_job, settings, root / "remeasure")
        median = {label: statistics.median(v) for label, v in again.items()}
        table = Table(
            title="tune on 2 cores: 2-rank DDP + prefetch workers + checkpoints (goodput, samples/s)"
        )
        for column in (
            "setting",
            "in its study (median of n)",
            f"side by side (median of {ROUNDS})",
            "range",
            "vs naive",
            "trials",
            "knobs",
        ):
            table.add_column(column, justify="left" if column in ("setting", "knobs") else "right")
        counts = {
            "tuned best": f"{trials_to_find(tuned)} ({len(tuned.study.trials)} with analysis)"
        }
        if grid is not None:
            counts["grid best"] = f"{trials_to_find(grid)}"
        for label, params in settings.items():
            table.add_row(
                label,
                f"{in_study[label]['goodput']:.1f} (n={in_study[label]['measured']})",
                f"{median[label]:.1f}",
                f"{min(again[label]):.1f}-{max(again[label]):.1f}",
                f"{median[label] / median['naive all on']:.2f}x",
                counts.get(label, ""),
                short_setting(params),
            )
        console.print(table)
        search = sum(1 for m in tuned.measured if m.role == "search")
        line = f"tuned: {len(tuned.study.trials)} trials ({search} by TPE); "
        if grid is not None:
            line += (
                f"grid: {len(grid.study.trials)} trials (grid of {grid_job.space.grid_size()}); "
                f"tuned / grid best side by side: {median['tuned best'] / median['grid best']:.2f}; "
            )
        console.print(line + f"noise in the tuned study: +-{document['noise']:.0%}")
    finally:
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
