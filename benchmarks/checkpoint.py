"""Checkpoint cost, side by side in one run: none; synchronous torch.save every k;
PyTorch DCP async_save every k (two-phase: staging awaited before the optimizer
step, at most one upload in flight, as torchtitan does); overlapkit's
two-phase checkpoint every k; and overlapkit in auto mode (CheckFreq's policy).

All of them run in the same loop and are timed by the same phase clock: the
stall is the ``ckpt_stall`` time, the overhead is the run's extra time over
the run without checkpoints. The raw memory-copy time of the state is
measured too, since a two-phase snapshot cannot beat it.

This machine's run-to-run noise (a whole 200-step run 5-10 % slower now and
then) is larger than the 3.5 % being measured, so: a discarded warm-up run
first (the first run in a process pays its page faults), then several
repeats in rotating order. The overhead is the median over repeats of each
repeat's run against the run without checkpoints of the same repeat (pairs
cancel the machine's slow spells); the range shows every repeat.

    python benchmarks/checkpoint.py [--steps 200] [--every 10] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from _cli import description, positive_int
from rich.console import Console
from rich.table import Table
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from overlapkit import Optimization, Session, get_optimization
from overlapkit.data import ResumableLoader, ShardedSampler, SyntheticImages
from overlapkit.models import ResNet
from overlapkit.runtime import State
from overlapkit.runtime.persist import atomic_torch_save
from overlapkit.runtime.rng import seed_everything

BATCH = 16


class SyncSave(Optimization):
    """torch.save (temporary file, fsync, rename) every k steps, on the training thread."""

    name = "sync_torch_save"

    def __init__(self, every: int, root: Path) -> None:
        super().__init__()
        self.every, self.root, self.stalls = every, root, []

    def on_step_start(self, state: State) -> None:
        if state.step and state.step % self.every == 0:
            start = time.perf_counter()
            with state.clock.phase("ckpt_stall"):
                atomic_torch_save(state.capture(), self.root / f"step-{state.step}.pt")
            self.stalls.append(time.perf_counter() - start)


class DcpAsyncSave(Optimization):
    """torch.distributed.checkpoint.async_save with asynchronous staging."""

    name = "dcp_async_save"

    def __init__(self, every: int, root: Path) -> None:
        super().__init__()
        self.every, self.root, self.stalls = every, root, []
        self._response: Any = None
        self._staging: Any = None
        self._stager = DefaultStager(StagingOptions(False, False, True, False))

    def on_step_start(self, state: State) -> None:
        if not (state.step and state.step % self.every == 0):
            return
        start = time.perf_counter()
        with state.clock.phase("ckpt_stall"):
            if self._response is not None:
                self._response.upload_completion.result()  # at most one in flight
            flat = {"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict()}
            self._response = dcp.async_save(
                flat, checkpoint_id=str(self.root / f"step-{state.step}"), async_stager=self._stager
            )
            self._staging = self._response.staging_completion
        self.stalls.append(time.perf_counter() - start)

    def on_before_optimizer_step(self, state: State) -> None:
        if self._staging is None:
            return
        start = time.perf_counter()
        with state.clock.phase("ckpt_stall"):
            self._staging.result()  # the state must not change while it is staged
        self.stalls[-1] += time.perf_counter() - start
        self._staging = None

    def on_fit_end(self, state: State) -> None:
        if self._response is not None:
            self._response.upload_completion.result()
        self._stager.close()


def train(optimizations: list[Optimization], steps: int, run_dir: Path) -> dict[str, Any]:
    seed_everything(0)
    model = ResNet("resnet18", "imagenet", num_classes=10)
    data = SyntheticImages((3, 32, 32), num_classes=10, num_samples=2048, seed=0)
    loader = ResumableLoader(data, BATCH, ShardedSampler(len(data), seed=0))
    session = Session(optimizations, device="cpu", run_dir=run_dir, warmup_steps=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer, _ = session.prepare(model, optimizer, loader)
    start = time.perf_counter()
    for inputs, targets in session.steps(steps + 3):
        with session.forward():
            loss = F.cross_entropy(model(inputs), targets)
        session.backward(loss)
        session.optimizer_step()
    summary = session.finish()
    summary["wall_s"] = time.perf_counter() - start
    return summary


def raw_copy_time(repeats: int = 5) -> tuple[float, int]:
    """Seconds to copy the model's and optimizer's tensors into preallocated memory."""
    model = ResNet("resnet18", "imagenet", num_classes=10)
    tensors = [p.detach() for p in model.parameters()] * 2  # parameters + momentum
    buffers = [torch.empty_like(t) for t in tensors]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for buffer, tensor in zip(buffers, tensors, strict=True):
            buffer.copy_(tensor)
        times.append(time.perf_counter() - start)
    return statistics.median(times), sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--steps", type=positive_int, default=200, help="steps per run")
    parser.add_argument(
        "--every",
        type=positive_int,
        default=10,
        help="steps between checkpoints (not in auto mode)",
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=5, help="runs of each configuration, rotating order"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="overlapkit-ckpt-bench-"))
    try:
        measure_and_print(args, scratch)
    finally:  # each run writes gigabytes: never leave them behind, even on Ctrl-C
        shutil.rmtree(scratch, ignore_errors=True)


def measure_and_print(args: argparse.Namespace, scratch: Path) -> None:
    checkpoint = get_optimization("checkpoint")
    dist.init_process_group("gloo", init_method=f"file://{scratch}/pg", rank=0, world_size=1)
    configs = {
        "none": lambda d: [],
        f"torch.save every {args.every}": lambda d: [SyncSave(args.every, d)],
        f"DCP async_save every {args.every}": lambda d: [DcpAsyncSave(args.every, d)],
        f"overlapkit every {args.every}": lambda d: [
            checkpoint(every=args.every, keep=2, final=False)
        ],
        "overlapkit auto (3.5 %)": lambda d: [checkpoint(every="auto", keep=2, final=False)],
    }
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    (scratch / "warm-up").mkdir()
    train([], 50, scratch / "warm-up")
    for repeat in range(args.repeats):
        names = list(configs)[repeat % len(configs) :] + list(configs)[: repeat % len(configs)]
        for name in names:
            run_dir = scratch / f"{repeat}-{len(results[name])}-{abs(hash(name))}"
            run_dir.mkdir()
            optimizations = configs[name](run_dir)
            summary = train(optimizations, args.steps, run_dir)
            shutil.rmtree(run_dir)
            checkpointer = optimizations[0] if optimizations else None
            stalls = getattr(checkpointer, "stalls", None) or getattr(checkpointer, "stalls_s", [])
            section = summary["optimizations"].get("checkpoint", {})
            results[name].append(
                {
                    "runtime_s": summary["runtime_s"],
                    "stalls": list(stalls),
                    "checkpoints": len(stalls),
                    "interval": section.get("auto_policy", {}).get("interval"),
                    "measured": section.get("auto_policy", {}).get("measured_overhead"),
                }
            )
    dist.destroy_process_group()
    copy_s, state_bytes = raw_copy_time()
    base = statistics.median(r["runtime_s"] for r in results["none"])
    table = Table(
        title=f"checkpointing ResNet-18 + SGD momentum ({state_bytes / 2**20:.0f} MiB of state), "
        f"{args.steps} steps of batch {BATCH}, {args.repeats} interleaved repeats; "
        f"raw copy of the state: {copy_s * 1e3:.1f} ms"
    )
    for column in (
        "configuration",
        "checkpoints",
        "interval",
        "stall ms / ckpt",
        "stall / raw copy",
        "overhead",
        "per repeat",
        "policy's own estimate",
    ):
        table.add_column(column, justify="left" if column == "configuration" else "right")
    numbers = {"raw_copy_s": copy_s, "state_bytes": state_bytes}
    for name, runs in results.items():
        runtime = statistics.median(r["runtime_s"] for r in runs)
        stalls = [s for r in runs for s in r["stalls"]]
        stall = statistics.median(stalls) if stalls else 0.0
        count = runs[-1]["checkpoints"]
        interval = runs[-1]["interval"] or (args.every if count else "")
        paired = [
            r["runtime_s"] / n["runtime_s"] - 1 for r, n in zip(runs, results["none"], strict=True)
        ]
        measured = [r["measured"] for r in runs if r["measured"] is not None]
        numbers[name] = {
            "runtime_s": runtime,
            "overhead": statistics.median(paired),
            "overhead_of_medians": runtime / base - 1,
            "stall_s": stall,
            "checkpoints": count,
            "interval": interval,
            "overhead_per_repeat": paired,
            "policy_estimate": statistics.median(measured) if measured else None,
        }
        table.add_row(
            name,
            str(count),
            str(interval),
            f"{stall * 1e3:.1f}" if count else "",
            f"{stall / copy_s:.2f}" if count else "",
            f"{statistics.median(paired):+.1%}",
            f"{min(paired):+.1%} .. {max(paired):+.1%}" if name != "none" else "",
            f"{statistics.median(measured):.1%}" if measured else "",
        )
    Console(width=160).print(table)
    if args.json:
        print(json.dumps(numbers, indent=2))


if __name__ == "__main__":
    main()
