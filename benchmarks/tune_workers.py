"""What `overlapkit tune --workers K` buys on this machine, side by side.

One study (the tiny scenario, 1 rank, checkpoints; 8 random trials of 10
measured steps, no references or confirm phase) run in a fresh folder each time:
  * 1 worker;
  * 2 workers, each on cores of its own (`tune`'s way: its block of the cores,
    the trial's threads sized to it);
  * 2 workers sharing every core (no split: each trial sizes its threads to the
    whole machine, as `tune` did before);
  * 3 workers (on 2 cores: one core each, in turn, `tune`'s way with more workers
    than cores).
Rounds in rotating order, medians: the study's wall time, and its trials' median
throughput (what the tuner compares; a worker's trial on 1 of 2 cores measures
less than one alone on both, by design).

    python benchmarks/tune_workers.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import yaml
from _cli import description, positive_int
from rich.console import Console
from rich.table import Table

from overlapkit.runtime.cores import available
from overlapkit.tuning import TuneConfig
from overlapkit.tuning.cores import split_cores
from overlapkit.tuning.runner import tune
from overlapkit.tuning.study import TuneJob, default_storage

SCENARIO = yaml.safe_load(
    """
name: tiny
model: {name: resnet18, stem: cifar, num_classes: 4, width: 8}
data: {name: synthetic-images, shape: [3, 32, 32], num_classes: 4, num_samples: 512}
train: {batch_size: 16, steps: 12, warmup_steps: 2, optimizer: {name: sgd, lr: 0.05}, seed: 0}
world: {nprocs: 1, device: cpu}
optimizations: {checkpoint: {every: 4}}
"""
)
TUNE = {
    "trials": 8,
    "sampler": "random",
    "references": False,
    "repeats": 1,
    "prune": False,
    "steps": 10,
    "warmup_steps": 2,
}
WAYS = {
    "1 worker": (1, False),
    "2 workers, own cores": (2, True),
    "2 workers, unpinned": (2, False),
    "3 workers, a core each in turn": (3, True),
}


def one_study(folder: Path, workers: int, own_cores: bool) -> tuple[float, float]:
    """The study's wall time and its trials' median samples/s."""
    job = TuneJob(SCENARIO, TuneConfig(**TUNE), folder, default_storage(folder), "tiny")
    cores = split_cores(workers, available()) if own_cores else None
    started = time.perf_counter()
    analysis = tune(job, workers=workers, console=Console(quiet=True), cores=cores)
    took = time.perf_counter() - started
    trials = analysis.study.get_trials(deepcopy=False)
    measured = [t.user_attrs["throughput"] for t in trials if "throughput" in t.user_attrs]
    return took, statistics.median(measured)


def main() -> None:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--rounds", type=positive_int, default=3)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-tune-workers-"))
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    rates: dict[str, list[float]] = {way: [] for way in WAYS}
    ways = list(WAYS)
    try:
        for round_ in range(args.rounds):
            for way in ways[round_ % len(ways) :] + ways[: round_ % len(ways)]:
                folder = scratch / f"{round_}-{way.replace(' ', '-').replace(',', '')}"
                took, rate = one_study(folder, *WAYS[way])
                times[way].append(took)
                rates[way].append(rate)
                print(
                    f"round {round_ + 1}: {way}: {took:.1f} s, trials' median {rate:.0f} samples/s"
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    base = statistics.median(times["1 worker"])
    table = Table(title=f"one study of {TUNE['trials']} trials, {len(available())} cores")
    for column in ("workers", "study s (median)", "range", "vs 1 worker", "trials' samples/s"):
        table.add_column(column, justify="left" if column == "workers" else "right")
    for way in WAYS:
        median = statistics.median(times[way])
        table.add_row(
            way,
            f"{median:.1f}",
            f"{min(times[way]):.1f}-{max(times[way]):.1f}",
            f"{base / median:.2f}x",
            f"{statistics.median(rates[way]):.0f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
