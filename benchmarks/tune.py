"""Does tuning give the same answer twice? The scenario of scenarios/tune-contend.yaml,
built to contend on a 2-core machine: 2-rank DDP (gloo), an input pipeline that
decodes on a core (0.5 ms of CPU per sample) with loader workers, and checkpoints.

The study (its tune section as shipped: ddp_overlap and prefetch intensities
0 / 0.5 / 1, policy free, priority or partition, partition's background_nice 0 or
19; goodput at MTBF 1 h, a 4 h job, 30 s restart, the checkpoint interval from the
Young/Daly model and a measured cost) runs --repeat-study times from scratch. Then
one final pass measures every pick, the naive combination (all on at full, policy
free) and the best single optimization side by side: --rounds rounds, each setting
once per round in an order rotated each round, fitted as paired ratios (a slow
round moves every setting in it alike). It prints the picks, their paired ratios
against naive and best single with 95 % intervals, and whether each study's claims
(the race's verdict, where each optimization stops paying, the checkpoint interval)
agree, and checks the targets:

  * every pick is within noise of the others, side by side;
  * no pick is beaten by naive or by best single beyond the noise;
  * the claims agree in every study, or are "within noise" in every study.

    python benchmarks/tune.py [--repeat-study 3] [--rounds 5] [--out runs/bench-tune]
    python benchmarks/tune.py --load   # a noisy day: another process takes a core in bursts
    python benchmarks/tune.py --repeat-study 1 --grid   # one study, and the exhaustive grid
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import random
import shutil
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml
from _cli import description, positive_int
from rich.console import Console
from rich.table import Table

from overlapkit.tuning import TuneConfig
from overlapkit.tuning.analysis import Analysis, setting_key, stops_paying
from overlapkit.tuning.paired import PairedFit
from overlapkit.tuning.race import round_order
from overlapkit.tuning.report import print_report, report_document, write_report
from overlapkit.tuning.runner import tune
from overlapkit.tuning.space import apply_params, short_setting
from overlapkit.tuning.study import TuneJob, default_storage, trial_metrics
from overlapkit.tuning.trial import run_trial, trial_scenario, with_checkpoints

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = yaml.safe_load((ROOT / "scenarios" / "tune-contend.yaml").read_text())
TUNE = SCENARIO.pop("tune")


def study(folder: Path, name: str, **overrides: Any) -> tuple[TuneJob, Analysis, float]:
    config = TuneConfig(**{**TUNE, **overrides})
    job = TuneJob(SCENARIO, config, folder, default_storage(folder), name)
    started = time.monotonic()
    analysis = tune(job, console=Console(stderr=True))
    return job, analysis, time.monotonic() - started


def claims(analysis: Analysis, document: dict[str, Any]) -> dict[str, str]:
    """What a study claims, as text to compare across studies."""
    race = document["race"]
    out = {
        "race": "within noise"
        if race and not race["separated"]
        else ("separated" if race else "no race")
    }
    for name, curve in document["curves"].items():
        out[f"{name} stops paying at"] = str(stops_paying(curve))
        out[f"{name} alone stops paying at"] = str(stops_paying(curve, alone=True))
    checkpoint = document["checkpoint"]
    if checkpoint is not None:
        out["checkpoints"] = "on" if checkpoint["alone"]["on"] else "off"
    return out


def best_single(documents: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The single optimization most studies found best alone (by throughput over the
    baseline), at the level most of them chose."""
    chosen = []
    for document in documents:
        singles = [r for r in document["comparison"] if r["row"].endswith(" alone") and r["params"]]
        if singles:
            top = max(singles, key=lambda r: r["vs_baseline"] or 0.0)
            chosen.append((top["row"].removesuffix(" alone"), json.dumps(top["params"])))
    (name, params), _ = Counter(chosen).most_common(1)[0]
    return name, json.loads(params)


def side_by_side(
    first: Analysis,
    settings: dict[str, dict[str, Any]],
    rounds: int,
    scratch: Path,
    console: Console,
) -> PairedFit:
    """Each setting once per round, in an order rotated each round, at the first study's
    checkpoint interval and its longest window; the paired fit of their throughput
    (their goodput at one interval is the same share of it)."""
    plan, tune_ = first.plan, first.tune
    labels = list(settings)
    rows = []
    for round_ in range(rounds):
        for label in round_order(labels, round_):
            data = apply_params(SCENARIO, first.space, settings[label])
            if plan is not None:
                data = with_checkpoints(data, plan.every if plan.on else None)
            data = trial_scenario(data, tune_.longest, tune_.warmup_steps)
            folder = scratch / f"{round_}-{labels.index(label)}"
            summary = run_trial(data, folder, tune_.trial_timeout_s)
            value = trial_metrics(summary, tune_, plan)["throughput"]
            rows.append((label, f"round-{round_}", value))
            console.print(f"final pass, round {round_ + 1}: {label}: {value:.1f} samples/s")
            shutil.rmtree(folder, ignore_errors=True)
    return PairedFit.of(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--out", type=Path, help="keep the studies here")
    parser.add_argument(
        "--repeat-study",
        type=positive_int,
        default=3,
        help="studies run from scratch (default 3)",
    )
    parser.add_argument(
        "--rounds", type=positive_int, default=5, help="rounds of the final side-by-side pass"
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=ROOT / "docs" / "tune-contention.png",
        help="the first study's contention plot, with tune-overview.png and tune-drift.png "
        "beside it (default: the README's, overwritten)",
    )
    parser.add_argument(
        "--grid", action="store_true", help="also run the exhaustive grid study, once"
    )
    parser.add_argument(
        "--load",
        action="store_true",
        help="a noisy day: another process keeps a core busy in random bursts throughout",
    )
    args = parser.parse_args()
    neighbour = None
    if args.load:
        neighbour = multiprocessing.get_context("spawn").Process(target=load, daemon=True)
        neighbour.start()
    root = args.out or Path(tempfile.mkdtemp(prefix="bench-tune-"))
    console = Console(width=200)
    day = time.strftime("%Y-%m-%d")
    try:
        runs = []
        for i in range(args.repeat_study):
            job, analysis, took = study(root / f"study-{i + 1}", f"study-{i + 1}")
            document = report_document(analysis)
            files = write_report(analysis, document, SCENARIO, job.folder)
            print_report(document, files, console)
            runs.append((job, analysis, document, files, took))
        first = runs[0]
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(first[3]["contention_plot"], args.plot)
        shutil.copy(first[3]["overview_plot"], args.plot.with_name("tune-overview.png"))
        if "drift_plot" in first[3]:
            shutil.copy(first[3]["drift_plot"], args.plot.with_name("tune-drift.png"))

        free = {"scheduler.policy": "free"}
        space = first[1].space
        single_name, single = best_single([run[2] for run in runs])
        settings: dict[str, dict[str, Any]] = {
            "naive all on": space.setting(free, **{n: "max" for n in space.optimizations}),
            f"best single ({single_name})": single,
        }
        picks = []
        for i, (_, analysis, *_rest) in enumerate(runs):
            label = f"pick {i + 1}"
            same = next(
                (
                    k
                    for k, p in settings.items()
                    if setting_key(p) == setting_key(analysis.best.params)
                ),
                None,
            )
            picks.append(same or label)
            if same is None:
                settings[label] = analysis.best.params
        fit = side_by_side(first[1], settings, args.rounds, root / "final", console)
        naive, single_label = "naive all on", f"best single ({single_name})"

        table = Table(title=f"tune-contend, {len(runs)} studies from scratch ({day}): the picks")
        for column in (
            "study",
            "pick",
            "trials",
            "minutes",
            "noise across / side by side",
            "drift",
            "checkpoint every",
            "race",
        ):
            table.add_column(
                column, justify="left" if column in ("pick", "race", "study") else "right"
            )
        for i, (_job, analysis, document, _, took) in enumerate(runs):
            drift = document["drift"]
            checkpoint = document["checkpoint"]
            table.add_row(
                str(i + 1),
                short_setting(analysis.best.params),
                str(len(analysis.study.trials)),
                f"{took / 60:.1f}",
                f"{document['noise']:.1%} / {document['paired_noise']:.1%}"
                if document["noise"] and document["paired_noise"]
                else "?",
                ""
                if drift is None
                else f"{drift['change']:+.1%}" + (" (corrected)" if drift["significant"] else ""),
                "" if checkpoint is None else str(checkpoint["every"]),
                claims(analysis, document)["race"],
            )
        console.print(table)

        ratios = Table(
            title=f"one final pass, {args.rounds} rounds side by side: paired ratios (95 % interval)"
        )
        for column in (
            "setting",
            "samples/s (paired)",
            "vs naive",
            "vs best single",
            "beaten beyond noise by",
        ):
            ratios.add_column(
                column,
                justify="left" if column in ("setting", "beaten beyond noise by") else "right",
            )
        for label in settings:
            beaten = [other for other in settings if fit.beats(other, label)]
            ratios.add_row(
                label
                + (
                    ""
                    if label not in picks
                    else f" = {', '.join(f'study {i + 1}' for i, p in enumerate(picks) if p == label)}"
                ),
                f"{fit.level(label):.1f}",
                _ratio(fit, label, naive),
                _ratio(fit, label, single_label),
                ", ".join(beaten) or "none",
            )
        console.print(ratios)

        every_claim = [claims(run[1], run[2]) for run in runs]
        agree = Table(title="claims of each study")
        agree.add_column("claim")
        for i in range(len(runs)):
            agree.add_column(f"study {i + 1}")
        agree.add_column("agree")
        same_claims = True
        for key in every_claim[0]:
            values = [c.get(key, "") for c in every_claim]
            ok = len(set(values)) == 1
            same_claims &= ok
            agree.add_row(key, *values, "yes" if ok else "NO")
        console.print(agree)

        unique = list(dict.fromkeys(picks))
        within = all(not fit.differs(a, b) for a in unique for b in unique if a != b)
        unbeaten = all(
            not fit.beats(ref, p) for p in unique for ref in (naive, single_label) if ref != p
        )
        console.print(
            f"targets: picks within noise of each other side by side: {'yes' if within else 'NO'}; "
            f"no pick beaten by naive or best single beyond noise: {'yes' if unbeaten else 'NO'}; "
            f"claims agree: {'yes' if same_claims else 'NO'}; final pass noise +-{fit.sigma:.1%} "
            f"(df {fit.df}); noise in each study (across the study / side by side): "
            + ", ".join(
                f"{d['noise']:.1%} / {d['paired_noise']:.1%}"
                if d["noise"] and d["paired_noise"]
                else "?"
                for _, _, d, _, _ in runs
            )
        )
        if args.grid:
            _, grid, took = study(
                root / "grid", "grid", sampler="grid", references=False, prune=False, trials=10_000
            )
            console.print(
                f"grid: {len(grid.study.trials)} trials in {took / 60:.1f} min, best "
                f"{short_setting(grid.best.params)}"
            )
        console.print(f"median minutes a study: {statistics.median(r[4] for r in runs) / 60:.1f}")
    finally:
        if neighbour is not None:
            neighbour.terminate()
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)


def load(seed: int = 0) -> None:
    """A noisy neighbour: a core busy for 0-4 s, then idle for 0-8 s, over and over
    (seeded), as another tenant's bursts would."""
    rng = random.Random(seed)
    while True:
        until = time.monotonic() + rng.uniform(0, 4)
        while time.monotonic() < until:
            sum(i * i for i in range(10_000))
        time.sleep(rng.uniform(0, 8))


def _ratio(fit: PairedFit, a: str, b: str) -> str:
    if a == b:
        return "1.00x"
    ratio, se = fit.ratio(a, b), fit.se(a, b)
    if se is None:
        return f"{ratio:.2f}x"
    half = fit.bound * se
    mark = "" if fit.differs(a, b) else " ~"
    return f"{ratio:.2f}x ({ratio * math.exp(-half):.2f}-{ratio * math.exp(half):.2f}){mark}"


if __name__ == "__main__":
    main()
