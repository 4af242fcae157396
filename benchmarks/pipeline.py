"""Pipeline schedules side by side: 2 and 4 stages, 1 to 16 micro-batches, every
schedule, against the same model unsplit on one process with all the cores;
then 2 stages x 2 replicas with DDP, where only the last micro-batch's backward
can hide the all-reduce.

The model is 16 equal layers (8 x Linear(1024, 1024) + ReLU), so that the
theoretical bubble (p-1)/(m+p-1) of GPipe and 1F1B, with p stages and m
micro-batches, applies as it stands; batch 64 per step. The measured bubble is
each rank's step time less its own forward and backward compute, averaged over
ranks. On this 2-core machine, 4 stages are 4 processes on 2 cores: there the
"bubble" also holds the time a ready rank waits for a core.

    python benchmarks/pipeline.py                 # the whole table (~3 minutes)
    python benchmarks/pipeline.py --stages 2 --microbatches 1 4 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _cli import description, positive_int
from rich.console import Console
from rich.table import Table
from torch import nn

from overlapkit import Session, get_optimization
from overlapkit.data import ResumableLoader, ShardedSampler, SyntheticImages
from overlapkit.launch.local import launch_local
from overlapkit.optimizations.pipeline.schedules import SCHEDULES
from overlapkit.runtime import CombinationError
from overlapkit.runtime.distributed import init_world
from overlapkit.runtime.rng import seed_everything

BATCH = 64
WIDTH = 1024
SHAPE = (1, 32, 32)  # flattened: 1024 inputs


def model() -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    for _ in range(8):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers[:-1], nn.Linear(WIDTH, 10))


def loader(shard: int = 0, shards: int = 1) -> ResumableLoader:
    data = SyntheticImages(SHAPE, num_classes=10, num_samples=4096, seed=0)
    return ResumableLoader(data, BATCH, ShardedSampler(len(data), shard, shards))


def train(optimizations: list[Any], steps: int, warmup: int, world: Any = None) -> dict[str, Any]:
    seed_everything(0)
    net = model()
    session = Session(optimizations, world=world, device="cpu", warmup_steps=warmup)
    shard, shards = session.data_shard
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    net, optimizer, _ = session.prepare(net, optimizer, loader(shard, shards))
    for inputs, targets in session.steps(warmup + steps):
        session.forward_backward(inputs, targets, F.cross_entropy)
        session.optimizer_step()
        session.end_step()
    return session.finish()


def configurations(stages: int, microbatches: list[int]) -> list[dict[str, Any]]:
    """Every (schedule, micro-batch count) the schedule accepts at this depth."""
    out = []
    for name in SCHEDULES:
        for m in microbatches:
            settings = {"stages": stages, "schedule": name, "microbatches": m, "split": "equal"}
            try:
                pipe = get_optimization("pipeline")(**settings)
                pipe.check(stages, "cpu", "gloo")
                pipe.resolve_microbatches(BATCH)
            except CombinationError:
                continue
            out.append(settings)
    return out


def rank_program(configs: list[dict[str, Any]], steps: int, warmup: int) -> list[dict[str, Any]]:
    world = init_world("cpu", "gloo")
    rows = []
    try:
        for settings in configs:
            summary = train([get_optimization("pipeline")(**settings)], steps, warmup, world)
            section = summary["optimizations"]["pipeline"]
            rows.append(
                {
                    **settings,
                    "samples_per_s": summary["samples_per_s"],
                    "bubble": section["measured"]["bubble_fraction"],
                    "ideal": section["measured"]["ideal_bubble_fraction"],
                    "step_s": summary["step_time_s"]["p50"],
                    "sent_mb": section["measured"]["sent_bytes_per_step"] / 2**20,
                }
            )
        return rows
    finally:
        dist.destroy_process_group()


def mesh_program(microbatches: list[int], steps: int, warmup: int) -> list[dict[str, Any]]:
    """2 stages x 2 replicas, DDP (1 MB buckets) in each stage's replica group: how much
    of the all-reduce backward hides, when only the last micro-batch's backward can."""
    world = init_world("cpu", "gloo")
    rows = []
    try:
        for m in microbatches:
            pipe = get_optimization("pipeline")(stages=2, microbatches=m, schedule="gpipe")
            ddp = get_optimization("ddp_overlap")(bucket_cap_mb=1.0)
            summary = train([pipe, ddp], steps, warmup, world)
            measured = summary["optimizations"]["pipeline"]["measured"]
            overlap = summary["optimizations"]["ddp_overlap"]["overlap"]
            rows.append(
                {
                    "microbatches": m,
                    "samples_per_s": summary["samples_per_s"],
                    "ddp_window": measured["ddp_window_fraction"],
                    "hidden": overlap["hidden_fraction"],
                    "comm_busy_ms": overlap["comm_busy_s_per_step"] * 1e3,
                    "comm_exposed_ms": overlap["comm_exposed_s_per_step"] * 1e3,
                    "step_ms": summary["step_time_s"]["p50"] * 1e3,
                }
            )
        return rows
    finally:
        dist.destroy_process_group()


def baseline(steps: int, warmup: int) -> float:
    torch.set_num_threads(2)
    return train([], steps, warmup)["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument(
        "--stages", type=positive_int, nargs="+", default=[2, 4], help="one rank each"
    )
    parser.add_argument(
        "--microbatches",
        type=positive_int,
        nargs="+",
        default=[1, 2, 4, 8, 16],
        help="for the schedules' tables; the 2 x 2 DDP table always runs 1, 2, 4 and 8",
    )
    parser.add_argument("--steps", type=positive_int, default=8, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--skip-mesh", action="store_true", help="no 2 x 2 DDP table")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    unsplit = baseline(args.steps * 2, args.warmup)
    results = {}
    for stages in args.stages:
        configs = configurations(stages, args.microbatches)
        results[stages] = launch_local(rank_program, stages, configs, args.steps, args.warmup)[0]
    mesh = (
        []
        if args.skip_mesh
        else launch_local(mesh_program, 4, [1, 2, 4, 8], args.steps, args.warmup)[0]
    )
    if args.json:
        out = {"unsplit_samples_per_s": unsplit, "pipelines": results, "mesh_ddp": mesh}
        print(json.dumps(out, indent=1))
        return
    console = Console()
    for stages, rows in results.items():
        table = Table(
            title=f"{stages} stages, batch {BATCH}, 16 equal layers; unsplit on 1 process with "
            f"2 threads: {unsplit:.0f} samples/s"
        )
        for column in ("schedule", "m", "samples/s", "vs unsplit", "bubble", "theory", "MB sent"):
            table.add_column(column, justify="left" if column == "schedule" else "right")
        for row in rows:
            ideal = row["ideal"]
            table.add_row(
                row["schedule"],
                str(row["microbatches"]),
                f"{row['samples_per_s']:.0f}",
                f"{row['samples_per_s'] / unsplit:.2f}x",
                f"{row['bubble']:.0%}",
                "-" if ideal is None else f"{ideal:.0%}",
                f"{row['sent_mb']:.2f}",
            )
        console.print(table)
    if mesh:
        table = Table(title="2 stages x 2 replicas, GPipe, ddp_overlap with 1 MB buckets")
        for column in ("m", "samples/s", "DDP window", "hidden", "busy ms", "exposed ms"):
            table.add_column(column, justify="right")
        for row in mesh:
            table.add_row(
                str(row["microbatches"]),
                f"{row['samples_per_s']:.0f}",
                f"{row['ddp_window']:.0%}",
                f"{row['hidden']:.0%}",
                f"{row['comm_busy_ms']:.1f}",
                f"{row['comm_exposed_ms']:.1f}",
            )
        console.print(table)
    medians = {
        stages: statistics.median(abs(r["bubble"] - r["ideal"]) for r in rows if r["ideal"])
        for stages, rows in results.items()
    }
    console.print(
        "median |measured - theoretical| bubble: "
        + ", ".join(f"{p} stages {gap:.0%}" for p, gap in medians.items())
        + f"; took {time.perf_counter() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
