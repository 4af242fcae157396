"""Scheduler policies side by side: free, priority and partition (with its
background at normal and at idle priority), on the contention scenario of
scenarios/tune-contend.yaml (2-rank DDP, loader workers decoding 0.5 ms of CPU
per sample, checkpoints every 2 steps) and on one rank whose loader either
burns CPU or waits (1.25 ms per sample, 2 workers, checkpoints every 5 steps).

The one-rank rows also answer whether ``free`` should leave the loader a core
by default: ``free, 1 thread`` runs it with world.threads 1 instead of 2.

Every setting runs ``--rounds`` times, each round in a rotated order, as its own
``overlapkit run`` process; the table shows medians, ranges and ratios to free.

    python benchmarks/partition.py [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from _cli import description, positive_int
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
CONTEND = yaml.safe_load((ROOT / "scenarios" / "tune-contend.yaml").read_text())
CONTEND.pop("tune")
ONE_RANK = {
    "name": "one-rank-loader",
    "model": {"name": "resnet18", "stem": "cifar", "num_classes": 10, "width": 8},
    "data": {
        "name": "synthetic-images",
        "shape": [3, 32, 32],
        "num_samples": 4096,
        "sample_cost_ms": 1.25,
    },
    "train": {"batch_size": 32, "steps": 30, "warmup_steps": 5},
    "world": {"nprocs": 1},
    "optimizations": {"prefetch": {"backend": "torch", "workers": 2}, "checkpoint": {"every": 5}},
}
CONTEND_EVERY_8 = {**CONTEND, "name": "contend-every-8"}
CONTEND_EVERY_8["optimizations"] = {**CONTEND["optimizations"], "checkpoint": {"every": 8}}
CONTEND_ALONE = {**CONTEND, "name": "contend-alone", "optimizations": {"checkpoint": {"every": 8}}}
POLICIES = {
    "free": [],
    "priority": ["scheduler.policy=priority"],
    "partition": ["scheduler.policy=partition"],
    "partition, background nice 19": [
        "scheduler.policy=partition",
        "scheduler.partition.background_nice=19",
    ],
}
CASES = {
    "contention, all on (2 ranks)": (CONTEND, [], list(POLICIES)),
    "contention, checkpoint every 8 alone": (CONTEND_ALONE, [], ["free"]),
    "contention, all on, checkpoint every 8": (CONTEND_EVERY_8, [], list(POLICIES)),
    "1 rank, loader burns CPU": (
        {**ONE_RANK, "name": "one-rank-cpu"},
        ["data.sample_cost=cpu"],
        ["free", "free, 1 thread", "priority", "partition", "partition, background nice 19"],
    ),
    "1 rank, loader waits (sleep)": (
        {**ONE_RANK, "name": "one-rank-sleep"},
        ["data.sample_cost=sleep"],
        ["free", "free, 1 thread", "partition", "partition, background nice 19"],
    ),
}  # fmt: skip


def settings_of(policy: str) -> list[str]:
    return ["world.threads=1"] if policy == "free, 1 thread" else POLICIES[policy]


def run(scenario: Path, sets: list[str], folder: Path) -> dict:
    command = [sys.executable, "-m", "overlapkit", "run", str(scenario), "--out", str(folder)]
    command += ["--quiet"] + [arg for s in sets for arg in ("--set", s)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    summary = json.loads((folder / "summary.json").read_text())
    split = (summary["scheduler"].get("partition") or [{}])[0]
    return {
        "samples_per_s": summary["samples_per_s"],
        "data_wait": summary["phase_shares"].get("data_wait", 0.0),
        "compute_threads": split.get("compute_threads"),
        "background_cores": len(split.get("background", [])) if split else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    console = Console(stderr=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-partition-"))
    try:  # every run keeps its checkpoints: hundreds of MB over 3 rounds
        files = {}
        for data, _, _ in CASES.values():
            path = scratch / f"{data['name']}.yaml"
            path.write_text(yaml.safe_dump(data))
            files[data["name"]] = path
        rows = [(case, policy) for case, (_, _, policies) in CASES.items() for policy in policies]
        results: dict[tuple[str, str], list[dict]] = {row: [] for row in rows}
        console.print(f"{len(rows)} settings x {args.rounds} rounds, {os.cpu_count()} cores")
        for round_ in range(args.rounds):
            shift = round_ * len(rows) // args.rounds
            for case, policy in rows[shift:] + rows[:shift]:
                data, sets, _ = CASES[case]
                folder = scratch / f"run-{sum(map(len, results.values()))}"
                out = run(files[data["name"]], sets + settings_of(policy), folder)
                results[(case, policy)].append(out)
                console.print(f"round {round_ + 1}: {case} / {policy}: {out['samples_per_s']:.1f}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    table = Table(
        title=f"scheduler policies on {os.cpu_count()} cores (samples/s, median of {args.rounds})"
    )
    for column in ("case", "policy", "samples/s", "range", "vs free", "data wait", "split"):
        table.add_column(
            column, justify="left" if column in ("case", "policy", "split") else "right"
        )
    out_rows = []
    for case, policy in rows:
        runs = results[(case, policy)]
        values = [r["samples_per_s"] for r in runs]
        median = statistics.median(values)
        free = statistics.median(r["samples_per_s"] for r in results[(case, "free")])
        threads = sorted({r["compute_threads"] for r in runs if r["compute_threads"]})
        split = ""
        if threads:
            own = sorted({r["background_cores"] for r in runs})
            split = f"compute {'/'.join(map(str, threads))} threads, background {'/'.join(map(str, own))} own"
        wait = statistics.median(r["data_wait"] for r in runs)
        table.add_row(
            case, policy, f"{median:.1f}", f"{min(values):.1f}-{max(values):.1f}",
            f"{median / free:.2f}x", f"{wait:.0%}", split,
        )  # fmt: skip
        out_rows.append(
            {"case": case, "policy": policy, "samples_per_s": values, "median": median,
             "vs_free": median / free, "data_wait": wait, "split": split}
        )  # fmt: skip
    Console(width=200).print(table)
    if args.json:
        args.json.write_text(json.dumps(out_rows, indent=2))


if __name__ == "__main__":
    main()
