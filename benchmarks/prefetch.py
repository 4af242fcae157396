"""prefetch: throughput of each back end at several intensities against intensity 0
and against the ideal bound, side by side in one run.

A synthetic source costs a known L per batch (``--load-ms``; spread over its
samples), either asleep (like waiting on storage: it needs no core) or busy on
a core (like decoding: it does). The model's step costs C (measured here on
batches already in memory). With ``w`` workers loading in parallel beside the
step, the ideal step is max(C, L / w); loading on the training thread
(intensity 0) costs C + L. Target: within 10 % of the bound where cores allow.
Where loading needs cores, ``w`` workers and the step's compute threads share
this machine's cores, and throughput falls away from the bound: the table
shows where. The "cores" bound adds what the cores allow: the CPU time a step
and a batch's loading take together (measured), spread over every core.

Each configuration runs ``--repeats`` times, in rotating order after a
discarded warm-up run; the table shows the median.

    python benchmarks/prefetch.py                 # prints the table
    python benchmarks/prefetch.py --json out.json # and writes the numbers
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
from _cli import csv_choices, description, positive_int
from rich.console import Console
from rich.table import Table
from torch import nn

from overlapkit import Session, get_optimization
from overlapkit.data import ResumableLoader, ShardedSampler, SyntheticImages
from overlapkit.optimizations.prefetch import BACKENDS
from overlapkit.optimizations.prefetch.extras import missing

Prefetch = get_optimization("prefetch")
BATCH, SHAPE, HIDDEN = 32, (3, 32, 32), 2048
INTENSITIES = (0.0, 0.25, 0.5, 1.0)  # workers 0, 1, 2, 4
KINDS = ("sleep", "cpu")  # --kinds: the source waits (storage) or burns a core (decoding)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(3 * 32 * 32, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, 10),
    )


def make_loader(load_ms: float, kind: str, steps: int) -> ResumableLoader:
    samples = BATCH * (steps + 8)  # one epoch covers the run: no epoch-end refill
    dataset = SyntheticImages(
        SHAPE, 10, samples, seed=0, cost_ms=load_ms / BATCH, cost_kind=kind, signal=0.5
    )
    return ResumableLoader(dataset, BATCH, ShardedSampler(samples, seed=0))


def train(session: Session, loader, steps: int) -> dict:
    model = make_model()
    model, optimizer, loader = session.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.01), loader
    )
    for inputs, targets in session.steps(steps + 5, loader):  # 5 warm-up steps first
        with session.forward():
            loss = nn.functional.cross_entropy(model(inputs), targets)
        session.backward(loss)
        session.optimizer_step()
    return session.finish()


def measure_compute(steps: int) -> tuple[float, float]:
    """C: the step on batches already in memory, through the same runtime; and
    the CPU time a step takes (all threads)."""
    batches = [(torch.randn(BATCH, *SHAPE), torch.randint(10, (BATCH,))) for _ in range(steps + 5)]
    session = Session([], device="cpu", warmup_steps=5, progress=False)
    cpu = time.process_time()
    summary = train(session, batches, steps)
    return summary["step_time_s"]["p50"], (time.process_time() - cpu) / (steps + 5)


def measure_load(load_ms: float, kind: str) -> tuple[float, float]:
    """L: loading and collating one batch on this thread; and its CPU time."""
    loader = make_loader(load_ms, kind, 8)
    iterator = iter(loader.loader)
    next(iterator)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(6):
        next(iterator)
    return (time.perf_counter() - start) / 6, (time.process_time() - cpu) / 6


@dataclass
class Config:
    kind: str
    backend: str
    intensity: float

    @property
    def key(self) -> tuple[str, str, float]:
        return (self.kind, self.backend, self.intensity)


def run_once(config: Config, load_ms: float, steps: int) -> dict:
    opt = Prefetch(config.intensity, backend=config.backend)
    session = Session([opt], device="cpu", warmup_steps=5, progress=False)
    summary = train(session, make_loader(load_ms, config.kind, steps + 5), steps)
    phases = summary["phase_shares"]
    return {
        "step_s": summary["step_time_s"]["p50"],
        "samples_per_s": summary["samples_per_s"],
        "data_wait_share": phases.get("data_wait", 0.0),
        "settings": {k: opt.settings[k] for k in ("workers", "depth", "device_depth")},
    }


def bound_step(compute_s: float, load_s: float, intensity: float, workers: int) -> float:
    if intensity == 0:
        return compute_s + load_s
    return max(compute_s, load_s / max(1, workers))


def cores_bound_step(ideal_s: float, compute_cpu_s: float, load_cpu_s: float) -> float:
    return max(ideal_s, (compute_cpu_s + load_cpu_s) / (os.cpu_count() or 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--load-ms", type=float, default=40.0, help="L, per batch of 32")
    parser.add_argument("--steps", type=positive_int, default=30)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument(
        "--kinds", default="sleep,cpu", help="sources: sleep, cpu (comma-separated)"
    )
    parser.add_argument(
        "--backends", default=",".join(BACKENDS), help=f"{', '.join(BACKENDS)} (comma-separated)"
    )
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()

    try:
        kinds = csv_choices(args.kinds, KINDS, "--kinds")
        asked = csv_choices(args.backends, tuple(BACKENDS), "--backends")
    except ValueError as error:
        parser.error(str(error))
    backends = [b for b in asked if not missing(b)]
    for backend in asked:
        if reason := missing(backend):
            print(f"skipped: {reason}", file=sys.stderr)
    if not backends:
        parser.error("--backends: none of them is installed here")
    configs = [Config(k, b, i) for k in kinds for b in backends for i in INTENSITIES]
    console = Console(stderr=True)
    console.print(f"{os.cpu_count()} cores, torch {torch.__version__}, {len(configs)} configs")

    measure_compute(args.steps)  # warm-up
    compute_s, compute_cpu_s = measure_compute(args.steps)
    measured = {kind: measure_load(args.load_ms, kind) for kind in kinds}
    loads = {kind: wall for kind, (wall, _) in measured.items()}
    load_cpus = {kind: cpu for kind, (_, cpu) in measured.items()}
    console.print(
        f"C = {compute_s * 1e3:.1f} ms ({compute_cpu_s * 1e3:.1f} ms CPU), "
        + ", ".join(
            f"L[{k}] = {loads[k] * 1e3:.1f} ms ({load_cpus[k] * 1e3:.1f} ms CPU)" for k in kinds
        )
    )
    run_once(configs[-1], args.load_ms, 10)  # warm-up: first-run costs land here
    results: dict[tuple, list[dict]] = {c.key: [] for c in configs}
    for repeat in range(args.repeats):
        shift = repeat * len(configs) // args.repeats
        for config in configs[shift:] + configs[:shift]:
            results[config.key].append(run_once(config, args.load_ms, args.steps))
        console.print(f"repeat {repeat + 1}/{args.repeats} done")

    rows = []
    for config in configs:
        runs = results[config.key]
        step = statistics.median(r["step_s"] for r in runs)
        settings = runs[0]["settings"]
        bound = bound_step(compute_s, loads[config.kind], config.intensity, settings["workers"])
        cores = bound
        if config.intensity > 0:
            cores = cores_bound_step(bound, compute_cpu_s, load_cpus[config.kind])
        base = statistics.median(r["step_s"] for r in results[(config.kind, config.backend, 0.0)])
        rows.append(
            {
                "source": config.kind,
                "backend": config.backend,
                "intensity": config.intensity,
                **settings,
                "step_ms": step * 1e3,
                "bound_ms": bound * 1e3,
                "of_bound": bound / step,
                "cores_bound_ms": cores * 1e3,
                "of_cores_bound": cores / step,
                "speedup": base / step,
                "samples_per_s": BATCH / step,
                "data_wait_share": statistics.median(r["data_wait_share"] for r in runs),
                "steps_ms": [r["step_s"] * 1e3 for r in runs],
            }
        )

    table = Table(
        title=f"prefetch: C = {compute_s * 1e3:.1f} ms, L = "
        + ", ".join(f"{loads[k] * 1e3:.1f} ms ({k})" for k in kinds)
        + f", batch {BATCH}, {os.cpu_count()} cores, median of {args.repeats}"
    )
    for column in (
        "source", "back end", "intensity", "workers", "depth", "dev depth",
        "step ms", "bound ms", "of bound", "cores bound ms", "of cores bound",
        "vs int. 0", "samples/s", "data wait",
    ):  # fmt: skip
        table.add_column(column, justify="left" if column in ("source", "back end") else "right")
    for row in rows:
        table.add_row(
            row["source"],
            row["backend"],
            f"{row['intensity']:g}",
            str(row["workers"]),
            str(row["depth"]),
            str(row["device_depth"]),
            f"{row['step_ms']:.1f}",
            f"{row['bound_ms']:.1f}",
            f"{row['of_bound']:.0%}",
            f"{row['cores_bound_ms']:.1f}",
            f"{row['of_cores_bound']:.0%}",
            f"{row['speedup']:.2f}x",
            f"{row['samples_per_s']:.0f}",
            f"{row['data_wait_share']:.0%}",
        )
    Console(width=200).print(table)
    if args.json:
        out = {
            "compute_ms": compute_s * 1e3,
            "compute_cpu_ms": compute_cpu_s * 1e3,
            "load_ms": {k: v * 1e3 for k, v in loads.items()},
            "load_cpu_ms": {k: v * 1e3 for k, v in load_cpus.items()},
        }
        with open(args.json, "w") as file:
            json.dump({**out, "rows": rows}, file, indent=2)


if __name__ == "__main__":
    main()
