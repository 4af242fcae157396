"""What a trial costs in start-up on Ray against a local worker, on this machine.

One trial of the tiny scenario (3 measured steps: the training itself takes well
under a second, so a trial's wall time is almost all start-up) run side by side,
rounds in rotating order, medians:
  * local: `overlapkit tune --workers K`'s way (`run_trial`: `overlapkit run` in a
    process of its own), 1 rank and 2 local ranks;
  * Ray: `overlapkit tune --ray`'s way (`RayTrials.run`: a placement group, an
    actor per machine, `overlapkit run` there, the run folder packed and brought
    back), 1 machine x 1 rank and 2 machines x 1 rank.
The cluster is real (Ray's cluster_utils: a head without CPUs and two worker nodes
of 2 CPUs on this machine); its own start and the driver's connection are one-off
costs, shown apart.

    python benchmarks/ray_startup.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import yaml
from _cli import description, positive_int
from rich.console import Console
from rich.table import Table

from overlapkit.launch.config import WorldConfig
from overlapkit.tuning.trial import run_trial, trial_scenario

SCENARIO = yaml.safe_load(
    """
name: tiny
model: {name: resnet18, stem: cifar, num_classes: 4, width: 4}
data: {name: synthetic-images, shape: [3, 16, 16], num_classes: 4, num_samples: 256}
train: {batch_size: 8, optimizer: {name: sgd, lr: 0.05}, seed: 0}
world: {nprocs: 1, device: cpu}
"""
)


def scenario(nprocs: int, nodes: int) -> dict:
    data = trial_scenario(SCENARIO, steps=3, warmup_steps=1)
    data["world"] = {**data["world"], "nprocs": nprocs, "nodes": nodes, "threads": 1}
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--rounds", type=positive_int, default=5)
    args = parser.parse_args()
    short = Path(tempfile.mkdtemp(prefix="okr", dir="/tmp"))
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=str(short))
    import ray
    from ray.cluster_utils import Cluster

    from overlapkit.tuning.on_ray import RayTrials

    started = time.perf_counter()
    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={"num_cpus": 0, "object_store_memory": 80_000_000},
    )
    for _ in range(2):
        cluster.add_node(num_cpus=2, object_store_memory=80_000_000)
    cluster.wait_for_nodes()
    cluster_s = time.perf_counter() - started
    scratch = Path(tempfile.mkdtemp(prefix="ray-startup-"))
    try:
        one = RayTrials(WorldConfig(nprocs=1, device="cpu"), cluster.address, None)
        two = RayTrials(WorldConfig(nprocs=1, nodes=2, device="cpu"), cluster.address, None)
        ways = {
            "local worker, 1 rank": lambda f: run_trial(scenario(1, 1), f, 300),
            "Ray, 1 machine x 1 rank": lambda f: one.run(scenario(1, 1), f, 300),
            "local worker, 2 ranks": lambda f: run_trial(scenario(2, 1), f, 300),
            "Ray, 2 machines x 1 rank": lambda f: two.run(scenario(1, 2), f, 300),
        }
        walls: dict[str, list[float]] = {name: [] for name in ways}
        names = list(ways)
        for round_ in range(args.rounds):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                folder = scratch / f"{round_}-{names.index(name)}"
                began = time.perf_counter()
                ways[name](folder)
                walls[name].append(time.perf_counter() - began)
        ray.shutdown()
    finally:
        cluster.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(short, ignore_errors=True)
    table = Table(title=f"one trial's wall time (3 measured steps), median of {args.rounds}")
    ranks = {name: 2 if "2" in name else 1 for name in walls}
    local = {ranks[n]: statistics.median(v) for n, v in walls.items() if n.startswith("local")}
    for column in ("where", "s per trial", "range", "more than local, same ranks"):
        table.add_column(column, justify="left" if column == "where" else "right")
    for name, values in walls.items():
        table.add_row(
            name,
            f"{statistics.median(values):.2f}",
            f"{min(values):.2f}-{max(values):.2f}",
            more_than_local(name, statistics.median(values), local[ranks[name]]),
        )
    console = Console()
    console.print(table)
    console.print(f"once: the local cluster (head + 2 worker nodes) started in {cluster_s:.1f} s")


def more_than_local(name: str, wall_s: float, local_s: float) -> str:
    """The extra cell: a local row is the reference itself, not '+0.00 s (1.00x)'."""
    if name.startswith("local"):
        return "— (reference)"
    return f"{wall_s - local_s:+.2f} s ({wall_s / local_s:.2f}x)"


if __name__ == "__main__":
    main()
