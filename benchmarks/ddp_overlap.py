"""Gradient all-reduce overlap: the no-overlap baseline against DDP at several
bucket sizes, on 2 local gloo ranks, and weak scaling over 1, 2 and 4 ranks.

All configurations run in one process group, interleaved (the order rotates
every repeat), so that drift in the machine's speed hits all of them alike.
The model is ResNet-18 (44.7 MB of fp32 gradients) on 32x32 inputs.

    python benchmarks/ddp_overlap.py                 # both tables
    python benchmarks/ddp_overlap.py --skip-scaling  # the bucket comparison only
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _cli import description, positive_int
from rich.console import Console
from rich.table import Table

from overlapkit import Session, get_optimization
from overlapkit.data import ResumableLoader, ShardedSampler, SyntheticImages
from overlapkit.launch.local import launch_local
from overlapkit.models import ResNet
from overlapkit.runtime.distributed import init_world
from overlapkit.runtime.rng import seed_everything

BATCH = 32  # per rank
CONFIGS: dict[str, dict[str, Any]] = {
    "no overlap (baseline)": {"intensity": 0.0},
    "one 256 MB bucket": {"bucket_cap_mb": 256.0},
    "64 MB buckets": {"bucket_cap_mb": 64.0},
    "25 MB buckets (DDP default)": {"bucket_cap_mb": 25.0},
    "4 MB buckets": {"bucket_cap_mb": 4.0},
    "1 MB buckets": {"bucket_cap_mb": 1.0},
    "25 MB + bucket view": {"bucket_cap_mb": 25.0, "gradient_as_bucket_view": True},
    "25 MB + fp16 hook": {"bucket_cap_mb": 25.0, "comm_hook": "fp16"},
}
QUICK = ["no overlap (baseline)", "4 MB buckets"]


def train_once(
    world: Any, settings: dict[str, Any] | None, steps: int, warmup: int
) -> dict[str, Any]:
    seed_everything(0)
    model = ResNet("resnet18", "imagenet", num_classes=10)
    data = SyntheticImages((3, 32, 32), num_classes=10, num_samples=4096, seed=0)
    sampler = ShardedSampler(len(data), world.rank, world.world_size, seed=0)
    optimizations = []
    if settings is not None:
        settings = dict(settings)
        optimizations.append(
            get_optimization("ddp_overlap")(settings.pop("intensity", 1.0), **settings)
        )
    session = Session(optimizations, world=world, warmup_steps=warmup)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer, _ = session.prepare(model, optimizer, ResumableLoader(data, BATCH, sampler))
    for inputs, targets in session.steps(warmup + steps):
        with session.forward():
            loss = F.cross_entropy(model(inputs), targets)
        session.backward(loss)
        session.optimizer_step()
    return session.finish()


def compare_buckets(steps: int, warmup: int, repeats: int, names: list[str]) -> dict[str, Any]:
    world = init_world("cpu", "gloo")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            runs[name].append(train_once(world, CONFIGS[name], steps, warmup))
    dist.destroy_process_group()
    return runs


def weak_scaling_rank(steps: int, warmup: int) -> dict[str, Any]:
    world = init_world("cpu", "gloo")
    settings = {"bucket_cap_mb": 25.0} if world.world_size > 1 else None
    summary = train_once(world, settings, steps, warmup)
    if world.world_size > 1:
        dist.destroy_process_group()
    return summary


def ddp_section(summary: dict[str, Any]) -> dict[str, Any]:
    return summary["optimizations"]["ddp_overlap"]


def median_of(runs: list[dict[str, Any]], getter: Any) -> float:
    return statistics.median(getter(run) for run in runs)


def bucket_table(runs: dict[str, list[dict[str, Any]]]) -> tuple[Table, dict[str, Any]]:
    baseline = median_of(runs["no overlap (baseline)"], lambda s: s["step_time_s"]["p50"])
    table = Table(
        title="ddp_overlap on 2 gloo ranks, ResNet-18 (44.7 MB of gradients), batch 32 per rank"
    )
    for column in (
        "configuration",
        "buckets",
        "step ms",
        "vs baseline",
        "backward ms",
        "comm busy ms",
        "exposed ms",
        "exposed / step",
        "hidden",
    ):
        table.add_column(column, justify="left" if column == "configuration" else "right")
    numbers = {}
    for name, results in runs.items():
        step = median_of(results, lambda s: s["step_time_s"]["p50"])
        busy = median_of(results, lambda s: ddp_section(s)["overlap"]["comm_busy_s_per_step"])
        exposed = median_of(results, lambda s: s["phases_s"]["comm_exposed"])
        hidden = median_of(results, lambda s: ddp_section(s)["overlap"]["hidden_fraction"])
        backward = median_of(results, lambda s: s["phases_s"]["backward"])
        buckets = ddp_section(results[-1])["buckets_per_step"]
        numbers[name] = {
            "step_s": step,
            "ratio": step / baseline,
            "backward_s": backward,
            "comm_busy_s": busy,
            "comm_exposed_s": exposed,
            "hidden_fraction": hidden,
            "buckets": buckets,
        }
        table.add_row(
            name,
            str(buckets),
            f"{step * 1e3:.1f}",
            f"{step / baseline:.3f}",
            f"{backward * 1e3:.1f}",
            f"{busy * 1e3:.1f}",
            f"{exposed * 1e3:.1f}",
            f"{exposed / step:.1%}",
            f"{hidden:.0%}",
        )
    return table, numbers


def profile_table(summary: dict[str, Any], title: str) -> Table:
    table = Table(title=title)
    for column in ("size class", "calls", "MiB", "mean ms", "p50 ms", "max ms", "MiB/s"):
        table.add_column(column, justify="left" if column == "size class" else "right")
    for row in summary["optimizations"]["ddp_overlap"]["allreduce_profile"]["classes"]:
        if row["calls"]:
            table.add_row(
                row["size_class"],
                str(row["calls"]),
                f"{row['bytes'] / 2**20:.1f}",
                f"{row['latency_ms_mean']:.1f}",
                f"{row['latency_ms_p50']:.1f}",
                f"{row['latency_ms_max']:.1f}",
                f"{row['bandwidth_mib_s']:.0f}",
            )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--steps", type=positive_int, default=8, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="two configurations, 2 steps, 1 repeat, no scaling table: a smoke test "
        "(it overrides --steps, --warmup, --repeats)",
    )
    args = parser.parse_args()
    console = Console(width=150)
    names = list(CONFIGS)
    if args.quick:
        names, args.steps, args.warmup, args.repeats, args.skip_scaling = QUICK, 2, 2, 1, True

    runs = launch_local(compare_buckets, 2, args.steps, args.warmup, args.repeats, names)[0]
    table, numbers = bucket_table(runs)
    console.print(table)
    console.print(
        profile_table(runs["no overlap (baseline)"][-1], "all-reduce profile, no overlap (rank 0)")
    )
    smallest = names[-1] if args.quick else "1 MB buckets"
    console.print(profile_table(runs[smallest][-1], f"all-reduce profile, {smallest} (rank 0)"))
    results: dict[str, Any] = {"buckets": numbers}

    if not args.skip_scaling:
        scaling = Table(
            title="weak scaling: batch 32 per rank, ddp_overlap 25 MB buckets (1 rank: no DDP)"
        )
        for column in (
            "ranks",
            "threads/rank",
            "samples/s",
            "per rank",
            "efficiency",
            "exposed / step",
        ):
            scaling.add_column(column, justify="right")
        single = None
        results["scaling"] = {}
        for ranks in (1, 2, 4):
            summary = launch_local(weak_scaling_rank, ranks, args.steps, args.warmup)[0]
            rate = summary["samples_per_s"]
            single = single or rate
            efficiency = rate / (ranks * single)
            exposed = summary["phases_s"]["comm_exposed"] / summary["step_time_s"]["mean"]
            threads = max(1, (torch.get_num_threads() or 1) // ranks)
            scaling.add_row(
                str(ranks),
                str(threads),
                f"{rate:.1f}",
                f"{rate / ranks:.1f}",
                f"{efficiency:.0%}",
                f"{exposed:.1%}",
            )
            results["scaling"][ranks] = {"samples_per_s": rate, "efficiency": efficiency}
        console.print(scaling)
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
