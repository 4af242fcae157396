"""One scenario on PyTorch and on TensorFlow, side by side in one run.

The scenario is scenarios/tf-distributed-prefetch.yaml and its torch twin: 2
ranks (DDP on gloo / MultiWorkerMirroredStrategy on gRPC collectives), ResNet-18
width 16 on 32x32 synthetic images that cost 0.5 ms of CPU each to load, batch
32 per rank. Each framework runs the same four settings of the same knobs:

  * no overlap: one all-reduce after backward, batches loaded when asked for;
  * + ddp_overlap (intensity 1): gradients reduced in buckets / packs as they
    are ready;
  * + prefetch (intensity 1): loader workers / tf.data's parallel map and
    prefetch load ahead;
  * + checkpoint every 5 steps: the two-phase checkpoint on top.

All runs rotate their order every round (the machine's slow spells hit all
alike); the tables show medians over rounds. On TensorFlow, forward, backward,
exposed communication and optimizer are one compiled step: their split is
read from a profiled window of warm-up steps (``phases_source`` in the
summary), labelled "sampled" below; data_wait and the checkpoint stall are
measured every step on both.

    python benchmarks/frameworks.py [--rounds 3] [--steps 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

import yaml
from _cli import description, positive_int
from rich.console import Console
from rich.table import Table

from overlapkit.run import run_scenario
from overlapkit.scenarios import Scenario

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("torch", "tensorflow")
SETTINGS: dict[str, dict[str, Any]] = {
    "no overlap": {"ddp_overlap": {"intensity": 0.0}, "prefetch": {"intensity": 0.0}},
    "+ ddp_overlap": {"ddp_overlap": {"intensity": 1.0}, "prefetch": {"intensity": 0.0}},
    "+ prefetch": {"ddp_overlap": {"intensity": 1.0}, "prefetch": {"intensity": 1.0}},
    "+ checkpoint every 5": {
        "ddp_overlap": {"intensity": 1.0},
        "prefetch": {"intensity": 1.0},
        "checkpoint": {"every": 5},
    },
}
QUICK = ["no overlap", "+ checkpoint every 5"]


def scenario_data(framework: str, setting: str, steps: int, warmup: int, folder: Path) -> dict:
    data = yaml.safe_load((ROOT / "scenarios" / "tf-distributed-prefetch.yaml").read_text())
    data["name"] = f"frameworks-{framework}"
    data["framework"] = framework
    data["train"].update(steps=steps, warmup_steps=warmup, eval={"at_end": False})
    data["train"]["lr_schedule"]["warmup_steps"] = warmup
    optimizations = json.loads(json.dumps(SETTINGS[setting]))
    if "checkpoint" in optimizations:
        optimizations["checkpoint"]["dir"] = str(folder / "checkpoints")
    data["optimizations"] = optimizations
    return data


def run_once(framework: str, setting: str, steps: int, warmup: int, scratch: Path) -> dict:
    folder = Path(tempfile.mkdtemp(dir=scratch))
    try:
        scenario = Scenario.model_validate(scenario_data(framework, setting, steps, warmup, folder))
        return run_scenario(scenario, folder / "run", progress=False, print_summary=False)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def figures(summary: dict[str, Any]) -> dict[str, float]:
    phases = summary["phases_s"]
    checkpoint = summary["optimizations"].get("checkpoint")
    return {
        "samples_per_s": summary["samples_per_s"],
        "step_s": summary["step_time_s"]["p50"],
        "data_wait_s": phases["data_wait"],
        "comm_exposed_s": phases["comm_exposed"],
        "compute_s": phases["forward"] + phases["backward"] + phases["optimizer"],
        "ckpt_stall_s": phases["ckpt_stall"],
        "checkpoints": checkpoint["checkpoints"] if checkpoint else 0,
        "packs": (
            summary["strategy"]["allreduce_packs_per_step"]
            if "strategy" in summary
            else summary["optimizations"]["ddp_overlap"].get("buckets_per_step", 1)
        ),
    }


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def table(numbers: dict[str, dict[str, dict[str, Any]]], names: list[str]) -> Table:
    out = Table(
        title="the same scenario on torch and TensorFlow: 2 ranks, ResNet-18 w16, batch 32/rank, "
        "0.5 ms/sample loading (medians over rounds; TF's compute/comm split is sampled)"
    )
    for column in (
        "setting",
        "framework",
        "samples/s",
        "range",
        "vs no overlap",
        "step ms",
        "data_wait ms",
        "compute ms",
        "comm exposed ms",
        "packs",
        "ckpt stall ms",
        "TF / torch",
    ):
        out.add_column(column, justify="left" if column in ("setting", "framework") else "right")
    for name in names:
        for framework in FRAMEWORKS:
            row = numbers[framework][name]
            base = numbers[framework][names[0]]["median"]["samples_per_s"]
            m = row["median"]
            ratio = (
                f"{m['samples_per_s'] / numbers['torch'][name]['median']['samples_per_s']:.2f}x"
                if framework == "tensorflow"
                else ""
            )
            sampled = " (s)" if framework == "tensorflow" else ""
            out.add_row(
                name if framework == "torch" else "",
                framework,
                f"{m['samples_per_s']:.0f}",
                f"{min(row['samples_per_s']):.0f}-{max(row['samples_per_s']):.0f}",
                f"{m['samples_per_s'] / base:.2f}x",
                f"{m['step_s'] * 1e3:.1f}",
                f"{m['data_wait_s'] * 1e3:.1f}",
                f"{m['compute_s'] * 1e3:.1f}{sampled}",
                f"{m['comm_exposed_s'] * 1e3:.1f}{sampled}",
                f"{m['packs']:.0f}",
                f"{m['ckpt_stall_s'] * 1e3:.2f}" if m["checkpoints"] else "-",
                ratio,
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument(
        "--steps", type=positive_int, default=30, help="steps per run, warm-up included"
    )
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="two settings, one round")
    args = parser.parse_args()
    names = list(SETTINGS)
    if args.quick:
        names, args.rounds, args.steps, args.warmup = QUICK, 1, 12, 4
    runs = [(framework, name) for name in names for framework in FRAMEWORKS]
    collected: dict[tuple[str, str], list[dict[str, float]]] = {run: [] for run in runs}
    console = Console(width=160, stderr=True)
    with tempfile.TemporaryDirectory(prefix="bench-frameworks-") as scratch:
        for round_ in range(args.rounds):
            shift = round_ % len(runs)
            for framework, name in runs[shift:] + runs[:shift]:
                console.print(f"round {round_ + 1}/{args.rounds}: {framework}, {name}")
                summary = run_once(framework, name, args.steps, args.warmup, Path(scratch))
                collected[framework, name].append(figures(summary))
    numbers = {
        framework: {
            name: {
                "median": medians(collected[framework, name]),
                "samples_per_s": [r["samples_per_s"] for r in collected[framework, name]],
            }
            for name in names
        }
        for framework in FRAMEWORKS
    }
    Console(width=160).print(table(numbers, names))
    if args.json:
        print(json.dumps(numbers, indent=2))


if __name__ == "__main__":
    main()
