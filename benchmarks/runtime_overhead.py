"""What the runtime costs: the built-in loop with no optimizations against a plain,
hand-written PyTorch loop on the same model, data and optimizer.

Runs are interleaved in ABBA order in one process so that drift in the
machine's speed hits both sides alike; the ratio is of the median run times.
Target: at most 1.02 on a realistic step (the runtime costs at most 2 %).

    python benchmarks/runtime_overhead.py            # prints a table
    python benchmarks/runtime_overhead.py --json     # and the numbers as JSON
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from _cli import description, positive_int
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from overlapkit.models import ResNet
from overlapkit.runtime import Session
from overlapkit.runtime.loop import OptimizerConfig, TrainConfig, build_optimizer, train


@dataclass
class Case:
    name: str
    make_model: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    steps: int


CASES = [
    Case("ResNet-18, ImageNet stem", lambda: ResNet("resnet18", "imagenet"), (3, 32, 32), 30),
    Case(
        "ResNet-18, CIFAR stem, width 16",
        lambda: ResNet("resnet18", "cifar", width=16),
        (3, 32, 32),
        20,
    ),
    Case("null step (Linear 8->10): the runtime's own cost", lambda: nn.Linear(8, 10), (8,), 2000),
    Case(
        "tiny MLP (worst case)",
        lambda: nn.Sequential(
            nn.Flatten(), nn.Linear(3 * 32 * 32, 256), nn.ReLU(), nn.Linear(256, 10)
        ),
        (3, 32, 32),
        400,
    ),
]
OPTIMIZER = OptimizerConfig(name="sgd", lr=0.01, momentum=0.9)


def make_loader(shape: tuple[int, ...], batches: int) -> DataLoader:
    """Ready-made batches in memory: both loops pay the same, small, cost for them."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(batches * 32, *shape, generator=generator)
    targets = torch.randint(10, (batches * 32,), generator=generator)
    return DataLoader(TensorDataset(inputs, targets), batch_size=32)


def plain_loop(model: nn.Module, loader: DataLoader, steps: int) -> float:
    optimizer = build_optimizer(OPTIMIZER, model)
    start = time.perf_counter()
    done = 0
    while done < steps:
        for inputs, targets in loader:
            loss = F.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            float(loss.detach())  # the runtime logs every step's loss: so does this loop
            done += 1
            if done == steps:
                break
    return time.perf_counter() - start


def runtime_loop(model: nn.Module, loader: DataLoader, steps: int) -> float:
    config = TrainConfig(batch_size=32, steps=steps, warmup_steps=0, optimizer=OPTIMIZER)
    start = time.perf_counter()
    train(config, Session(device="cpu"), model, loader)
    return time.perf_counter() - start


def measure(case: Case, repeats: int) -> dict[str, float]:
    loader = make_loader(case.input_shape, batches=min(case.steps, 50))
    model = case.make_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    runners = {"plain": plain_loop, "overlapkit": runtime_loop}
    times: dict[str, list[float]] = {"plain": [], "overlapkit": []}
    plain_loop(model, loader, min(5, case.steps))  # warm the allocator and kernels
    for i in range(repeats):
        order = ["plain", "overlapkit"] if i % 2 == 0 else ["overlapkit", "plain"]
        for name in order:
            model.load_state_dict(initial)
            times[name].append(runners[name](model, loader, case.steps))
    plain, ours = statistics.median(times["plain"]), statistics.median(times["overlapkit"])
    pair_ratios = sorted(o / p for o, p in zip(times["overlapkit"], times["plain"], strict=True))
    return {
        "pair_ratio_min": pair_ratios[0],
        "pair_ratio_max": pair_ratios[-1],
        "plain_step_ms": plain / case.steps * 1e3,
        "overlapkit_step_ms": ours / case.steps * 1e3,
        "overhead_us_per_step": (ours - plain) / case.steps * 1e6,
        "ratio": ours / plain,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument(
        "--repeats", type=positive_int, default=6, help="runs per side (interleaved)"
    )
    parser.add_argument("--quick", action="store_true", help="few steps, for a smoke test")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    cases = CASES
    if args.quick:
        cases = [
            Case(c.name, c.make_model, c.input_shape, max(2, c.steps // 20)) for c in CASES[1:3]
        ]
        args.repeats = 2
    results = {case.name: measure(case, args.repeats) for case in cases}
    # Two noisy 100 ms loops cannot resolve a difference of tens of microseconds; the
    # null step measures the runtime's absolute cost per step, which implies the ratio.
    null = next((r for n, r in results.items() if n.startswith("null")), None)
    for r in results.values():
        if null is not None:
            r["implied_ratio"] = 1 + null["overhead_us_per_step"] / (r["plain_step_ms"] * 1e3)

    table = Table(
        title=f"runtime overhead: built-in loop vs plain PyTorch loop, 32x32 inputs, batch 32 "
        f"({args.repeats} interleaved runs each, medians, {torch.get_num_threads()} threads; "
        "ratio = overlapkit / plain)"
        + (" --quick: a smoke test, too few steps to quote" if args.quick else "")
    )
    table.add_column("model")
    table.add_column("plain ms/step", justify="right")
    table.add_column("overlapkit ms/step", justify="right")
    table.add_column("overhead µs/step", justify="right")
    table.add_column("ratio", justify="right")
    table.add_column("per pair", justify="right")
    table.add_column("implied by null step", justify="right")
    for name, r in results.items():
        table.add_row(
            name,
            f"{r['plain_step_ms']:.2f}",
            f"{r['overlapkit_step_ms']:.2f}",
            f"{r['overhead_us_per_step']:.0f}",
            f"{r['ratio']:.3f}",
            f"{r['pair_ratio_min']:.3f}-{r['pair_ratio_max']:.3f}",
            f"{r['implied_ratio']:.4f}" if "implied_ratio" in r else "",
        )
    Console(width=160).print(table)
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
