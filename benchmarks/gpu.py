"""GPU benchmark: loop overhead, checkpoint cost, prefetch and precision, in one run.

Side by side on one GPU: what the runtime's loop costs, what checkpointing
costs, what prefetching buys and what lower precision buys. One command,
estimated at 4-5 minutes on one H100 (target: under 8).

(a) Loop overhead. The built-in loop (``overlapkit.runtime.loop.train`` on a
    `Session`: what ``overlapkit run`` runs on each rank) against two plain
    PyTorch loops on the same model, batches and optimizer (SGD, momentum 0.9,
    built by the same function as the built-in loop's): one that never waits
    for the GPU (``torch.cuda.synchronize()`` only around the measured window)
    and one that reads the loss every step (``float(loss)``: one sync a step).
    ResNet-18 batch 128 and ResNet-50 batch 256, CIFAR-size (32x32, 10
    classes), fp32. The batches, the scenario's synthetic images, are already
    on the device and cycled, so only the loops differ. One more row runs the
    whole ``run_scenario`` path, where the synthetic-images loader makes every
    batch on the CPU as the step asks for it (no prefetch): what ``overlapkit
    run`` gives; beside it a plain loop over a torch DataLoader of the same
    images (no workers, pinned memory, non-blocking copies), so that the cost
    of making batches on the CPU is not taken for the runtime's. Target: the
    built-in loop at most 1.02x the plain no-sync loop.
(b) Checkpoint cost, ResNet-50 + SGD momentum, in the built-in loop: none;
    torch.save every k (temporary file, fsync, rename); DCP async_save every
    k (its DefaultStager: pinned memory, non-blocking copies on a side stream,
    staging awaited before the optimizer step, at most one upload in flight,
    as torchtitan does); overlapkit every k; overlapkit auto. The overhead is
    each round's run time against that round's run without checkpoints (the
    median over rounds); the stall is the ``ckpt_stall`` phase of the step
    that took each checkpoint (steps.jsonl), the first checkpoint's (it pays
    for the host buffers) beside the later ones'; "own timer" is what each
    measures of its stall itself (torch.save and DCP: the host's clock around
    their calls; overlapkit: CUDA events, the device's timeline). The warm-up
    run takes one checkpoint. Target: overhead <= 2 %.
    DCP needs a process group: a one-rank gloo group on 127.0.0.1.
(c) Prefetch intensity 0 against 1 on a slow source: synthetic images that
    take ``--sample-cost-ms`` each (asleep, like storage), ResNet-18 through
    ``run_scenario``; samples/s, against the compute-only rate of (a).
(d) fp32 / bf16 / fp16 throughput of the built-in loop (bf16 only on compute
    capability 8.0 and up; fp16 only on a GPU).

Every configuration runs ``--rounds`` times in rotating order, after one
discarded warm-up run each; times are medians over rounds and ratios the
median of each round's pair. A time is the wall clock over the measured
window: synchronize, the steps after the warm-up steps, synchronize (in the
built-in loop a benchmark-only hook does the same at the window's first step
start and at fit end; its per-step cost is a few microseconds). Work still in
flight when the last step ends (a persist, an upload) is drained after the
window, as in a long run where it would overlap the following steps.

    python benchmarks/gpu.py                         # all four parts, tables
    python benchmarks/gpu.py --json gpu.json         # and the numbers as JSON
    python benchmarks/gpu.py --parts b --dir /nvme   # checkpoints on that disk
    python benchmarks/gpu.py --device cpu --quick    # CPU smoke test: tiny sizes, every code path
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from inspect import signature
from itertools import cycle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _cli import description, positive_int
from rich.console import Console
from rich.table import Table
from torch import nn

from overlapkit import Optimization, Session, get_optimization, register_optimization
from overlapkit.data import SyntheticImages
from overlapkit.models import ResNet
from overlapkit.run import run_scenario
from overlapkit.runtime.distributed import process_group_backend, resolve_backend
from overlapkit.runtime.loop import OptimizerConfig, TrainConfig, build_optimizer, train
from overlapkit.scenarios import Scenario

try:
    import torch.distributed.checkpoint as dcp
except ImportError:  # a torch build without distributed
    dcp = None
try:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
except ImportError:  # torch < 2.9: async_save stages on the calling thread
    DefaultStager = StagingOptions = None

OPTIMIZER = OptimizerConfig(name="sgd", lr=0.01, momentum=0.9)
SHAPE = (3, 32, 32)
MODELS = {"resnet18": "ResNet-18", "resnet50": "ResNet-50"}
PRECISIONS = ("fp32", "bf16", "fp16")
TARGET_LOOP, TARGET_CKPT = 1.02, 0.02


@dataclass
class Sizes:
    width: int = 64  # ResNet channels after the stem (64: the standard networks)
    batch: dict[str, int] = field(default_factory=lambda: {"resnet18": 128, "resnet50": 256})
    pool: int = 8  # distinct batches kept on the device and cycled
    warmup: int = 10  # (a) and (d)
    steps: int = 60  # (a)
    precision_steps: int = 40  # (d)
    ckpt_warmup: int = 1  # (b): short, so that auto mode's first checkpoint is measured
    ckpt_steps: int = 100  # (b)
    every: int = 10  # (b)
    prefetch_warmup: int = 10  # (c)
    prefetch_steps: int = 40  # (c)
    rounds: int = 3

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            width=8,
            batch={"resnet18": 8, "resnet50": 8},
            pool=2,
            warmup=1,
            steps=3,
            precision_steps=3,
            ckpt_steps=8,
            every=3,
            prefetch_warmup=2,
            prefetch_steps=4,
            rounds=2,
        )


# ------------------------------------------------------------------ helpers
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def phase(state: Any, name: str) -> AbstractContextManager[Any]:
    """The runtime's phase clock, where it has one (it is being reworked)."""
    clock_phase = getattr(getattr(state, "clock", None), "phase", None)
    return clock_phase(name) if clock_phase is not None else nullcontext()


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def rotate(names: list[str], by: int) -> list[str]:
    by %= len(names)
    return names[by:] + names[:by]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(name: str, width: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return ResNet(name, "cifar", num_classes=10, width=width).to(device)


def make_optimizer(model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """The built-in loop's own optimizer for this device (fused SGD on a GPU, where
    the runtime uses it), so that the plain loops differ from it in the loop only."""
    try:
        return build_optimizer(OPTIMIZER, model, device)
    except TypeError:  # a runtime whose build_optimizer takes no device
        return build_optimizer(OPTIMIZER, model)


def make_batches(batch: int, pool: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """``pool`` batches of the scenarios' synthetic images (seed 0), on the device."""
    data = SyntheticImages(SHAPE, 10, batch * pool, seed=0)
    samples = [data[i] for i in range(batch * pool)]
    images = torch.stack([image for image, _ in samples])
    labels = torch.tensor([label for _, label in samples])
    return [
        (
            images[i * batch : (i + 1) * batch].to(device),
            labels[i * batch : (i + 1) * batch].to(device),
        )
        for i in range(pool)
    ]


@dataclass
class Workload:
    """A model on the device, its initial state (each run starts from it) and its batches."""

    name: str
    batch: int
    model: nn.Module
    initial: dict[str, torch.Tensor]
    batches: list[tuple[torch.Tensor, ...]]

    @classmethod
    def make(cls, name: str, sizes: Sizes, device: torch.device) -> Workload:
        model = make_model(name, sizes.width, device)
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        batch = sizes.batch[name]
        return cls(name, batch, model, initial, make_batches(batch, sizes.pool, device))

    def reset(self) -> nn.Module:
        self.model.load_state_dict(self.initial)
        return self.model


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fresh_host_cache(device: torch.device) -> None:
    """The pinned memory earlier runs left in torch's caching host allocator (it keeps
    freed pinned blocks) given back, and its peak reset: each run's first checkpoint
    pays for its host buffers as in a new process."""
    gc.collect()
    if device.type != "cuda":
        return
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    empty = empty or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()
    reset = getattr(torch.cuda, "reset_peak_host_memory_stats", None)
    if reset is not None:
        reset()


def pinned_peak_bytes(device: torch.device) -> int | None:
    """The most pinned memory the host allocator held since `fresh_host_cache` (None:
    no GPU, or a torch without host memory statistics)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if device.type != "cuda" or stats is None:
        return None
    return stats().get("allocated_bytes.peak")


@register_optimization
class Stopwatch(Optimization):
    """Benchmark only: the wall clock from the first measured step's start to fit end,
    synchronized with the device at both ends. No knobs, no resources."""

    name = "gpu_bench_stopwatch"

    def __init__(self, intensity: float = 1.0, **explicit: Any) -> None:
        super().__init__(intensity, **explicit)
        self._start: float | None = None
        self._end: float | None = None
        self._first = self._last = 0

    def on_step_start(self, state: Any) -> None:
        if self._start is None and state.step >= state.warmup_steps:
            sync(state.world.device)
            self._start, self._first = time.perf_counter(), state.step

    def on_fit_end(self, state: Any) -> None:
        sync(state.world.device)
        self._end, self._last = time.perf_counter(), state.step

    def result(self) -> dict[str, float]:
        if self._start is None or self._end is None:
            return {"window_s": float("nan"), "steps": 0}
        return {"window_s": self._end - self._start, "steps": self._last - self._first}

    def summary(self) -> dict[str, Any]:
        return self.result()


@dataclass
class Context:
    device: torch.device
    sizes: Sizes
    scratch: Path
    log: Console
    quick: bool
    runs: int = 0

    def run_dir(self) -> Path:
        self.runs += 1
        path = self.scratch / f"run-{self.runs:04d}"
        path.mkdir(parents=True)
        return path


def read_steps(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -------------------------------------------------------------------- loops
def plain_loop(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, ...]],
    warmup: int,
    steps: int,
    device: torch.device,
    sync_each_step: bool,
) -> dict[str, Any]:
    """A plain PyTorch loop over ``batches`` (the device's pool, cycled; or a loader's,
    copied as they come), timed over the steps after ``warmup``."""
    optimizer = make_optimizer(model, device)
    start = time.perf_counter()
    for i, (inputs, targets) in zip(range(warmup + steps), batches, strict=False):
        if i == warmup:
            sync(device)
            start = time.perf_counter()
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if sync_each_step:
            float(loss.detach())
    sync(device)
    return {"window_s": time.perf_counter() - start, "steps": steps}


def plain_loader_loop(
    model: nn.Module, batch: int, warmup: int, steps: int, device: torch.device
) -> dict[str, Any]:
    """A plain loop (no per-step sync) over a torch DataLoader of the synthetic images
    ``run_scenario`` reads, as a script would load them: no workers, pinned memory on
    a GPU, non-blocking copies."""
    data = SyntheticImages(SHAPE, 10, batch * (warmup + steps + 8), seed=0)
    loader = torch.utils.data.DataLoader(
        data, batch_size=batch, shuffle=True, drop_last=True, pin_memory=device.type == "cuda"
    )
    copied = (
        (inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True))
        for inputs, targets in loader
    )
    return plain_loop(model, copied, warmup, steps, device, False)


def builtin_loop(
    ctx: Context,
    model: nn.Module,
    batches: list[tuple[torch.Tensor, ...]],
    warmup: int,
    steps: int,
    precision: str = "fp32",
    optimizations: Callable[[Path], list[Optimization]] = lambda run_dir: [],
) -> dict[str, Any]:
    """The built-in loop on batches already on the device, writing its run folder."""
    run_dir = ctx.run_dir()
    try:
        extra = optimizations(run_dir)
        stopwatch = Stopwatch()  # last: its fit-end hook runs first, before any draining
        session = Session(
            [*extra, stopwatch],
            device=ctx.device.type,
            precision=precision,  # type: ignore[arg-type]
            warmup_steps=warmup,
            run_dir=run_dir,
            name="gpu-bench",
        )
        cfg = TrainConfig(
            batch_size=len(batches[0][1]),
            steps=steps,
            warmup_steps=warmup,
            optimizer=OPTIMIZER,
            precision=precision,
        )
        summary = train(cfg, session, model, batches)
        return {
            **stopwatch.result(),
            "summary": summary,
            "records": read_steps(run_dir),
            "optimizations": extra,
        }
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def scenario_loop(
    ctx: Context,
    model_name: str,
    warmup: int,
    steps: int,
    sample_cost_ms: float = 0.0,
    optimizations: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole ``run_scenario`` path (what ``overlapkit run`` does) on synthetic images."""
    batch = ctx.sizes.batch[model_name]
    spec = {
        "name": "gpu-bench",
        "model": {"name": model_name, "stem": "cifar", "num_classes": 10, "width": ctx.sizes.width},
        "data": {
            "name": "synthetic-images",
            "shape": list(SHAPE),
            "num_samples": batch * (warmup + steps + 8),  # one epoch: no refill mid-run
            "eval_samples": 0,
            "sample_cost_ms": sample_cost_ms,
            "sample_cost": "sleep",
        },
        "train": {
            "batch_size": batch,
            "steps": steps,
            "warmup_steps": warmup,
            "optimizer": OPTIMIZER.model_dump(mode="json"),
            "eval": {"every": 0, "at_end": False},
        },
        "world": {"nprocs": 1, "device": ctx.device.type},
        "optimizations": {**(optimizations or {}), Stopwatch.name: {}},
    }
    run_dir = ctx.run_dir()
    try:
        summary = run_scenario(
            Scenario.model_validate(spec), run_dir, progress=False, print_summary=False
        )
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {**summary["optimizations"][Stopwatch.name], "summary": summary}


def measure(
    ctx: Context,
    what: str,
    runners: dict[str, Callable[[int, int], dict[str, Any]]],
    warmup: int,
    steps: int,
    warmup_run: tuple[int, int] = (1, 2),
) -> dict[str, list[dict[str, Any]]]:
    """One discarded warm-up run of each (``warmup_run``: its warm-up steps and
    steps; none with --quick, a smoke test: the rounds run the same code), then
    ``rounds`` rounds in rotating order."""
    for name, runner in runners.items() if not ctx.quick else ():
        ctx.log.print(f"  {what}: warm-up {name}")
        runner(*warmup_run)
        gc.collect()
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
    for round_ in range(ctx.sizes.rounds):
        for name in rotate(list(runners), round_):
            ctx.log.print(f"  {what}: round {round_ + 1}/{ctx.sizes.rounds} {name}")
            results[name].append(runners[name](warmup, steps))
            if not ctx.quick:  # (a tenth of a second each: most of a smoke test's rounds)
                gc.collect()
    return results


def per_step_ms(runs: list[dict[str, Any]]) -> float:
    return median([r["window_s"] / r["steps"] * 1e3 for r in runs if r["steps"]])


def paired(runs: list[dict[str, Any]], base: list[dict[str, Any]]) -> list[float]:
    """Each round's time over the same round's base time."""
    return [r["window_s"] / b["window_s"] for r, b in zip(runs, base, strict=True)]


def new_table(title: str, columns: list[str]) -> Table:
    table = Table(title=title, title_justify="left")
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i < 2 else "right")
    return table


# ---------------------------------------------------------- (a) the loop
PLAIN, PLAIN_SYNC = "plain, no per-step sync", "plain, float(loss) every step"
BUILTIN, SCENARIO = "overlapkit built-in loop", "overlapkit run_scenario (CPU loader)"
PLAIN_LOADER = "plain, the same CPU loader"


def per_model(
    ctx: Context, measure: Callable[[Context, Workload], dict[str, Any]]
) -> dict[str, Any]:
    """``measure`` on each model's workload, freeing the device between them."""
    out = {name: measure(ctx, Workload.make(name, ctx.sizes, ctx.device)) for name in MODELS}
    release(ctx.device)
    return out


def part_a(ctx: Context) -> dict[str, Any]:
    return per_model(ctx, part_a_model)


def part_a_model(ctx: Context, wl: Workload) -> dict[str, Any]:
    s, device = ctx.sizes, ctx.device
    runners = {
        PLAIN: lambda w, n: plain_loop(wl.reset(), cycle(wl.batches), w, n, device, False),
        PLAIN_SYNC: lambda w, n: plain_loop(wl.reset(), cycle(wl.batches), w, n, device, True),
        BUILTIN: lambda w, n: builtin_loop(ctx, wl.reset(), wl.batches, w, n),
        SCENARIO: lambda w, n: scenario_loop(ctx, wl.name, w, n),
        PLAIN_LOADER: lambda w, n: plain_loader_loop(wl.reset(), wl.batch, w, n, device),
    }
    results = measure(ctx, f"(a) {MODELS[wl.name]}", runners, s.warmup, s.steps)
    rows = {}
    for name, runs in results.items():
        ratios = paired(runs, results[PLAIN])
        own = [r["summary"]["step_time_s"]["mean"] * 1e3 for r in runs if "summary" in r]
        rows[name] = {
            "ms_per_step": per_step_ms(runs),
            "samples_per_s": wl.batch / per_step_ms(runs) * 1e3,
            "ratio": median(ratios),
            "ratio_per_round": ratios,
            "summary_step_ms": median(own) if own else None,
        }
    # run_scenario against a plain loop over the same loader: the runtime's share alone
    rows[SCENARIO]["ratio_to_plain_loader"] = median(
        paired(results[SCENARIO], results[PLAIN_LOADER])
    )
    return {"batch": wl.batch, "rows": rows}


def print_a(ctx: Context, console: Console, a: dict[str, Any]) -> None:
    s = ctx.sizes
    table = new_table(
        f"(a) loop overhead, CIFAR-size (32x32, 10 classes), fp32, SGD momentum 0.9: "
        f"{s.steps} steps after {s.warmup} warm-up steps, median of {s.rounds} rounds; "
        f"ratio = to the plain no-sync loop; target: built-in <= {TARGET_LOOP:.2f}x",
        [
            "model",
            "loop",
            "ms/step",
            "samples/s",
            "ratio",
            "per round",
            "its own step_time_s",
            "target",
        ],
    )
    table.caption = f"{SCENARIO} over {PLAIN_LOADER}: " + ", ".join(
        f"{MODELS[m]} {e['rows'][SCENARIO]['ratio_to_plain_loader']:.3f}x" for m, e in a.items()
    )
    table.caption_justify = "left"
    for model_name, entry in a.items():
        for i, (name, row) in enumerate(entry["rows"].items()):
            target = ""
            if name == BUILTIN:
                target = "met" if row["ratio"] <= TARGET_LOOP else "MISSED"
                if ctx.device.type != "cuda" or ctx.quick:
                    target = "(smoke)"
            own = row["summary_step_ms"]
            table.add_row(
                f"{MODELS[model_name]} b{entry['batch']}" if i == 0 else "",
                name,
                f"{row['ms_per_step']:.2f}",
                f"{row['samples_per_s']:.0f}",
                f"{row['ratio']:.3f}",
                " ".join(f"{r:.3f}" for r in row["ratio_per_round"]),
                f"{own:.2f} ms" if own is not None else "",
                target,
            )
        table.add_section()
    console.print(table)


# ----------------------------------------------------- (b) checkpointing
class TorchSaveEvery(Optimization):
    """torch.save of the model and optimizer every k steps, on the training thread:
    temporary file, fsync, rename; the newest two kept."""

    name = "gpu_bench_torch_save"

    def __init__(self, every: int, root: Path) -> None:
        super().__init__()
        self.every, self.root = every, root
        self.stalls_s: list[float] = []
        self._paths: list[Path] = []

    def on_step_start(self, state: Any) -> None:
        if not (state.step and state.step % self.every == 0):
            return
        start = time.perf_counter()
        with phase(state, "ckpt_stall"):
            path = self.root / f"step-{state.step}.pt"
            temporary = path.with_suffix(".tmp")
            with open(temporary, "wb") as f:
                torch.save(
                    {"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict()},
                    f,
                )
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, path)
            self._paths.append(path)
            while len(self._paths) > 2:
                self._paths.pop(0).unlink(missing_ok=True)
        self.stalls_s.append(time.perf_counter() - start)


def flat_state(state: Any) -> dict[str, Any]:
    """The model's and optimizer's tensors in one plain dict (no OrderedDict, no
    param_groups): what DefaultStager copies without tripping over a class object in
    the state (``KeyError: <class 'type'>`` in some torch versions' stager)."""
    out: dict[str, Any] = {f"model.{k}": v for k, v in state.model.state_dict().items()}
    for index, per_param in state.optimizer.state_dict()["state"].items():
        for key, value in per_param.items():
            if value is not None:
                out[f"optimizer.{index}.{key}"] = value
    return out


class DcpAsyncSaveEvery(Optimization):
    """torch.distributed.checkpoint.async_save every k steps: staging (GPU to CPU) in
    the background, awaited before the optimizer step; at most one upload in flight;
    the newest two checkpoints kept."""

    name = "gpu_bench_dcp_async_save"

    def __init__(self, every: int, root: Path, device: torch.device) -> None:
        super().__init__()
        self.every, self.root, self.device = every, root, device
        self.stalls_s: list[float] = []
        self._dirs: list[Path] = []
        self._response: Any = None
        self._staging: Any = None
        self._stager: Any = None
        if DefaultStager is not None and "async_stager" in signature(dcp.async_save).parameters:
            cuda = device.type == "cuda"
            # Made here, on the main thread: on a GPU it makes its staging stream.
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=cuda,
                )
            )

    @property
    def mode(self) -> str:
        if self._stager is None:
            return "DCP stages on the training thread (no DefaultStager in this torch)"
        pinned = (
            "pinned memory, non-blocking copies on its stream"
            if self.device.type == "cuda"
            else "pageable memory"
        )
        return f"DCP: DefaultStager, staging in its thread ({pinned})"

    def _after_compute(self) -> None:
        """The stager copies on its own stream from another thread, without waiting for
        the work queued on the compute stream: make its stream wait for that work."""
        if self.device.type != "cuda":
            return
        stream = getattr(self._stager, "_staging_stream", None)
        try:
            if stream is None:
                raise AttributeError("no staging stream")
            stream.wait_stream(torch.cuda.current_stream(self.device))
        except Exception:
            torch.cuda.current_stream(self.device).synchronize()

    def _wait_upload(self) -> None:
        if self._response is not None:
            getattr(self._response, "upload_completion", self._response).result()
            self._response = None
            while len(self._dirs) > 2:
                shutil.rmtree(self._dirs.pop(0), ignore_errors=True)

    def on_step_start(self, state: Any) -> None:
        if not (state.step and state.step % self.every == 0):
            return
        start = time.perf_counter()
        with phase(state, "ckpt_stall"):
            self._wait_upload()  # at most one in flight: its staging buffers are reused
            path = self.root / f"step-{state.step}"
            flat = flat_state(state)
            if self._stager is not None:
                self._after_compute()
                self._response = dcp.async_save(
                    flat, checkpoint_id=str(path), async_stager=self._stager
                )
                self._staging = getattr(self._response, "staging_completion", None)
            else:
                self._response = dcp.async_save(flat, checkpoint_id=str(path))
            self._dirs.append(path)
        self.stalls_s.append(time.perf_counter() - start)

    def on_before_optimizer_step(self, state: Any) -> None:
        if self._staging is None:
            return
        start = time.perf_counter()
        with phase(state, "ckpt_stall"):
            self._staging.result()  # the state must not change while it is staged
        self._staging = None
        self.stalls_s[-1] += time.perf_counter() - start

    def on_fit_end(self, state: Any) -> None:
        self._wait_upload()
        if self._stager is not None:
            self._stager.close()


def raw_copy_ms(model: nn.Module, device: torch.device, repeats: int = 5) -> tuple[float, int]:
    """Copying parameters and momentum (as many bytes again) into reused host memory:
    a two-phase snapshot cannot beat it."""
    tensors = [p.detach() for p in model.parameters()] * 2
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=device.type == "cuda") for t in tensors]
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        for buffer, tensor in zip(host, tensors, strict=True):
            buffer.copy_(tensor, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - start)
    return median(times) * 1e3, sum(t.numel() * t.element_size() for t in tensors)


def ckpt_stalls_ms(records: list[dict[str, Any]]) -> list[float]:
    """The ``ckpt_stall`` phase of each step that had one, in step order (one per checkpoint)."""
    stalls = sorted(
        (r["step"], r.get("phases_s", {}).get("ckpt_stall", 0.0))
        for r in records
        if r.get("rank", 0) == 0
    )
    return [s * 1e3 for _, s in stalls if s > 0]


def part_b(ctx: Context, max_overhead: float) -> dict[str, Any]:
    out = part_b_measure(ctx, Workload.make("resnet50", ctx.sizes, ctx.device), max_overhead)
    release(ctx.device)
    return out


def part_b_measure(ctx: Context, wl: Workload, max_overhead: float) -> dict[str, Any]:
    s, device = ctx.sizes, ctx.device
    copy_ms, state_bytes = raw_copy_ms(wl.model, device)
    checkpoint = get_optimization("checkpoint")
    k = s.every
    configs: dict[str, Callable[[Path], list[Optimization]]] = {
        "none": lambda d: [],
        f"torch.save every {k}": lambda d: [TorchSaveEvery(k, d)],
    }
    if dcp is not None:
        configs[f"DCP async_save every {k}"] = lambda d: [DcpAsyncSaveEvery(k, d, device)]
    configs[f"overlapkit every {k}"] = lambda d: [checkpoint(every=k, keep=2, final=False)]
    configs[f"overlapkit auto ({max_overhead:.0%})"] = lambda d: [
        checkpoint(every="auto", max_overhead=max_overhead, keep=2, final=False)
    ]

    def runner(make: Callable[[Path], list[Optimization]]) -> Callable[[int, int], dict[str, Any]]:
        def go(warmup: int, steps: int) -> dict[str, Any]:
            fresh_host_cache(device)
            result = builtin_loop(ctx, wl.reset(), wl.batches, warmup, steps, optimizations=make)
            checkpointer = result["optimizations"][0] if result["optimizations"] else None
            section = result["summary"]["optimizations"].get("checkpoint", {})
            host = list(getattr(checkpointer, "stalls_s", []) or [])
            return {
                "window_s": result["window_s"],
                "steps": result["steps"],
                "phase_stalls_ms": ckpt_stalls_ms(result["records"]),
                # The host buffers are reserved in a thread after step 0: if that held
                # up the training thread, steps 1-5 would show it (JSON only).
                "first_steps_ms": [
                    r["step_time_s"] * 1e3
                    for r in sorted(result["records"], key=lambda r: r["step"])[:6]
                    if r.get("rank", 0) == 0
                ],
                "host_stalls_ms": [x * 1e3 for x in host],
                "checkpoints": section.get("checkpoints", len(host)),
                "checkpoint_section": {
                    key: section.get(key)
                    for key in (
                        "stall_s_mean",
                        "snapshot_copy_s_mean",
                        "persist_s_mean",
                        "bytes_written",
                        "host_buffer_bytes",
                        "notes",
                    )
                    if key in section
                },
                "interval": (section.get("auto_policy") or {}).get("interval"),
                "policy_estimate": (section.get("auto_policy") or {}).get("measured_overhead"),
                "dcp_mode": getattr(checkpointer, "mode", None),
                "pinned_bytes": section.get("pinned_bytes"),
                "pinned_peak_bytes": pinned_peak_bytes(device),
            }

        return go

    owns_group = False
    if dcp is not None and not dist.is_initialized():
        # The group the sessions adopt: the one overlapkit starts on this device (on a
        # GPU nccl with gloo beside it; DCP's stager needs gloo). A gloo-only group
        # on a GPU is refused by the sessions (they resolve the backend to nccl).
        cuda = ctx.device.type == "cuda"
        dist.init_process_group(
            process_group_backend(resolve_backend("auto", ctx.device.type)),
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
            device_id=torch.device("cuda", torch.cuda.current_device()) if cuda else None,
        )
        owns_group = True
    try:
        runners = {name: runner(make) for name, make in configs.items()}
        # The warm-up runs take a checkpoint each: first-time costs (a saver's threads,
        # a file system's first write) are not the first round's.
        results = measure(ctx, "(b) checkpoints", runners, s.ckpt_warmup, s.ckpt_steps, (1, k + 2))
    finally:
        if owns_group:
            dist.destroy_process_group()
    rows: dict[str, Any] = {}
    for name, runs in results.items():
        overheads = [r - 1 for r in paired(runs, results["none"])]
        stalls = [x for r in runs for x in r["phase_stalls_ms"]]
        firsts = [r["phase_stalls_ms"][0] for r in runs if r["phase_stalls_ms"]]
        laters = [median(r["phase_stalls_ms"][1:]) for r in runs if len(r["phase_stalls_ms"]) > 1]
        host = [x for r in runs for x in r["host_stalls_ms"]]
        estimates = [r["policy_estimate"] for r in runs if r["policy_estimate"] is not None]
        rows[name] = {
            "ms_per_step": per_step_ms(runs),
            "overhead": median(overheads),
            "overhead_per_round": overheads,
            "checkpoints": [r["checkpoints"] for r in runs],
            "interval": runs[-1]["interval"] or (k if runs[-1]["checkpoints"] else None),
            "ckpt_stall_ms_per_ckpt": median(stalls) if stalls else None,
            "first_ckpt_stall_ms": median(firsts) if firsts else None,
            "later_ckpt_stall_ms": median(laters) if laters else None,
            "host_wait_ms_per_ckpt": median(host) if host else None,
            "policy_estimate": median(estimates) if estimates else None,
            "checkpoint_section": runs[-1]["checkpoint_section"],
            "first_steps_ms_per_round": [r["first_steps_ms"] for r in runs],
            "dcp_mode": runs[-1]["dcp_mode"],
            "pinned_bytes": runs[-1]["pinned_bytes"],
            "pinned_peak_bytes": runs[-1]["pinned_peak_bytes"],
        }
    return {
        "model": wl.name,
        "batch": wl.batch,
        "state_bytes": state_bytes,
        "raw_copy_ms": copy_ms,
        "rows": rows,
    }


def print_b(ctx: Context, console: Console, b: dict[str, Any]) -> None:
    s = ctx.sizes
    table = new_table(
        f"(b) checkpointing {MODELS[b['model']]} b{b['batch']} + SGD momentum "
        f"({b['state_bytes'] / 2**20:.0f} MiB of parameters and momentum; raw copy to host "
        f"{b['raw_copy_ms']:.1f} ms): {s.ckpt_steps} steps after {s.ckpt_warmup}, median of "
        f"{s.rounds} rounds; overhead = run time over the same round's run without; "
        f"stall = ckpt_stall phase of the checkpoint's step; target: overhead <= {TARGET_CKPT:.0%}",
        [
            "configuration",
            "ckpts/run",
            "interval",
            "ms/step",
            "overhead",
            "per round",
            "stall ms/ckpt",
            "1st ckpt",
            "later",
            "own timer ms",
            "policy's estimate",
            "pinned MiB: summary / allocator peak",
        ],
    )

    def ms(value: float | None) -> str:
        return f"{value:.1f}" if value is not None else ""

    for name, row in b["rows"].items():
        counts = sorted(set(row["checkpoints"]))
        table.add_row(
            name,
            f"{counts[0]}-{counts[-1]}" if len(counts) > 1 else str(counts[0]),
            str(row["interval"] or ""),
            f"{row['ms_per_step']:.2f}",
            f"{row['overhead']:+.1%}" if name != "none" else "",
            " ".join(f"{o:+.1%}" for o in row["overhead_per_round"]) if name != "none" else "",
            ms(row["ckpt_stall_ms_per_ckpt"]),
            ms(row["first_ckpt_stall_ms"]),
            ms(row["later_ckpt_stall_ms"]),
            ms(row["host_wait_ms_per_ckpt"]),
            f"{row['policy_estimate']:.1%}" if row["policy_estimate"] is not None else "",
            " / ".join(
                f"{row[key] / 2**20:.0f}" if row[key] is not None else "-"
                for key in ("pinned_bytes", "pinned_peak_bytes")
            ),
        )
    modes = [row["dcp_mode"] for row in b["rows"].values() if row["dcp_mode"]]
    table.caption = modes[0] if modes else None
    table.caption_justify = "left"
    console.print(table)


# ----------------------------------------------------------- (c) prefetch
def part_c(ctx: Context, sample_cost_ms: float, a: dict[str, Any] | None) -> dict[str, Any]:
    s = ctx.sizes
    model_name = "resnet18"
    runners = {
        f"intensity {i}": (
            lambda w, n, i=i: scenario_loop(
                ctx, model_name, w, n, sample_cost_ms, {"prefetch": {"intensity": float(i)}}
            )
        )
        for i in (0, 1)
    }
    results = measure(ctx, "(c) prefetch", runners, s.prefetch_warmup, s.prefetch_steps)
    batch = s.batch[model_name]
    compute = None
    if a and model_name in a:
        compute = a[model_name]["rows"][BUILTIN]["samples_per_s"]
    rows = {}
    base = per_step_ms(results["intensity 0"])
    for name, runs in results.items():
        summary = runs[-1]["summary"]
        settings = summary["optimizations"].get("prefetch", {})
        step_ms = per_step_ms(runs)
        rows[name] = {
            "ms_per_step": step_ms,
            "samples_per_s": batch / step_ms * 1e3,
            "speedup": base / step_ms,
            "data_wait_share": median(
                [r["summary"].get("phase_shares", {}).get("data_wait", float("nan")) for r in runs]
            ),
            "of_compute_only": (batch / step_ms * 1e3) / compute if compute else None,
            "settings": {
                k: settings.get(k) for k in ("workers", "depth", "device_depth", "backend")
            },
        }
    return {
        "model": model_name,
        "batch": batch,
        "sample_cost_ms": sample_cost_ms,
        "load_ms_per_batch": sample_cost_ms * batch,
        "compute_only_samples_per_s": compute,
        "rows": rows,
    }


def print_c(ctx: Context, console: Console, c: dict[str, Any]) -> None:
    s = ctx.sizes
    compute = c["compute_only_samples_per_s"]
    table = new_table(
        f"(c) prefetch on a slow source: {MODELS[c['model']]} b{c['batch']} through run_scenario, "
        f"synthetic images at {c['sample_cost_ms']} ms/sample asleep ({c['load_ms_per_batch']:.1f} ms "
        f"a batch); {s.prefetch_steps} steps after {s.prefetch_warmup}, median of {s.rounds} rounds"
        + (f"; compute only (a, built-in loop): {compute:.0f} samples/s" if compute else ""),
        [
            "prefetch",
            "workers/depth/on device",
            "ms/step",
            "samples/s",
            "vs intensity 0",
            "data_wait share",
            "of compute only",
        ],
    )
    for name, row in c["rows"].items():
        st = row["settings"]
        table.add_row(
            name,
            f"{st.get('workers')}/{st.get('depth')}/{st.get('device_depth')}",
            f"{row['ms_per_step']:.2f}",
            f"{row['samples_per_s']:.0f}",
            f"{row['speedup']:.2f}x",
            f"{row['data_wait_share']:.1%}",
            f"{row['of_compute_only']:.0%}" if row["of_compute_only"] else "",
        )
    console.print(table)


# ---------------------------------------------------------- (d) precision
def precision_unavailable(device: torch.device, precision: str) -> str | None:
    if device.type != "cuda":
        return "n/a on cpu" if precision == "fp16" else None
    if precision == "bf16":
        if torch.cuda.get_device_capability(device) < (8, 0) or not torch.cuda.is_bf16_supported():
            return "n/a (needs compute capability 8.0)"
    return None


def part_d(ctx: Context) -> dict[str, Any]:
    return per_model(ctx, part_d_model)


def part_d_model(ctx: Context, wl: Workload) -> dict[str, Any]:
    s, device = ctx.sizes, ctx.device

    def runner(precision: str) -> Callable[[int, int], dict[str, Any]]:
        return lambda w, n: builtin_loop(ctx, wl.reset(), wl.batches, w, n, precision=precision)

    runnable = [p for p in PRECISIONS if precision_unavailable(device, p) is None]
    results = measure(
        ctx, f"(d) {MODELS[wl.name]}", {p: runner(p) for p in runnable}, s.warmup, s.precision_steps
    )
    rows: dict[str, Any] = {}
    fp32 = per_step_ms(results["fp32"])
    for p in PRECISIONS:
        reason = precision_unavailable(device, p)
        if reason is not None:
            rows[p] = {"unavailable": reason}
            continue
        step_ms = per_step_ms(results[p])
        rows[p] = {
            "ms_per_step": step_ms,
            "samples_per_s": wl.batch / step_ms * 1e3,
            "speedup": fp32 / step_ms,
            "final_loss": results[p][-1]["summary"].get("final_loss"),
        }
    return {"batch": wl.batch, "rows": rows}


def print_d(ctx: Context, console: Console, d: dict[str, Any]) -> None:
    s = ctx.sizes
    table = new_table(
        f"(d) precision, built-in loop, CIFAR-size: {s.precision_steps} steps after {s.warmup}, "
        f"median of {s.rounds} rounds (bf16: autocast; fp16: autocast and grad scaler)",
        ["model", "precision", "ms/step", "samples/s", "vs fp32", "final loss"],
    )
    for model_name, entry in d.items():
        for i, (p, row) in enumerate(entry["rows"].items()):
            first = f"{MODELS[model_name]} b{entry['batch']}" if i == 0 else ""
            if "unavailable" in row:
                table.add_row(first, p, row["unavailable"], "", "", "")
                continue
            loss = row["final_loss"]
            table.add_row(
                first,
                p,
                f"{row['ms_per_step']:.2f}",
                f"{row['samples_per_s']:.0f}",
                f"{row['speedup']:.2f}x",
                f"{loss:.3f}" if loss is not None else "",
            )
        table.add_section()
    console.print(table)


# ------------------------------------------------------------------- main
def environment(device: torch.device, quick: bool) -> dict[str, Any]:
    env: dict[str, Any] = {
        "device": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cpu_cores": os.cpu_count(),
        "quick": quick,
        "python": sys.version.split()[0],
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name,
            compute_capability=".".join(map(str, torch.cuda.get_device_capability(device))),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
        )
    optimizer = make_optimizer(nn.Linear(2, 2).to(device), device)
    env["optimizer"] = (
        f"SGD lr {OPTIMIZER.lr} momentum {OPTIMIZER.momentum}, "
        f"fused={bool(optimizer.defaults.get('fused'))}, foreach={optimizer.defaults.get('foreach')}"
    )
    return env


def disk_write_mb_s(folder: Path, nbytes: int) -> float:
    """This folder's write rate, fsync included (part (b) writes ~22 GB there: below
    ~400 MB/s the persists queue up and its overheads measure the disk)."""
    chunk = bytes(16 << 20)
    path = folder / "write-rate.bin"
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // len(chunk))):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    written = path.stat().st_size
    path.unlink()
    return written / seconds / 1e6


def header(console: Console, env: dict[str, Any]) -> None:
    if env["device"] == "cuda":
        console.print(
            f"[bold]GPU[/bold] {env['gpu']} ({env['gpu_memory_gib']} GiB), compute capability "
            f"{env['compute_capability']}; torch {env['torch']}, CUDA {env['cuda']}, "
            f"cuDNN {env['cudnn']}; {env['cpu_cores']} CPU cores; {env['optimizer']}"
            + (
                "  [yellow](--quick: tiny sizes, not the benchmark's numbers)[/yellow]"
                if env["quick"]
                else ""
            )
        )
    else:
        console.print(
            f"[bold yellow]CPU {'smoke ' if env['quick'] else ''}run: NOT GPU numbers[/bold yellow]"
            f"{' (tiny sizes, to exercise every code path)' if env['quick'] else ''}; "
            f"no GPU (compute capability n/a); torch {env['torch']}, CUDA {env['cuda']}; "
            f"{env['cpu_cores']} CPU cores; {env['optimizer']}"
        )
    console.print(
        f"checkpoints written to {env['scratch']} ({env['disk_write_mb_s']} MB/s with fsync; "
        "--dir chooses another disk)",
        highlight=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default=None, help="default: cuda if there is one"
    )
    parser.add_argument(
        "--quick",
        "--smoke",
        action="store_true",
        help="tiny sizes: a smoke test of every code path",
    )
    parser.add_argument("--parts", default="a,b,c,d", help="which parts to run (comma-separated)")
    parser.add_argument(
        "--rounds", type=positive_int, default=None, help="rounds per configuration (default 3)"
    )
    parser.add_argument("--steps", type=positive_int, default=None, help="(a) measured steps")
    parser.add_argument("--ckpt-steps", type=positive_int, default=None, help="(b) measured steps")
    parser.add_argument(
        "--every", type=positive_int, default=None, help="(b) steps between checkpoints"
    )
    parser.add_argument(
        "--auto-max-overhead", type=float, default=TARGET_CKPT, help="(b) auto mode's budget"
    )
    parser.add_argument("--sample-cost-ms", type=float, default=0.3, help="(c) per sample, asleep")
    parser.add_argument(
        "--dir", type=Path, default=None, help="scratch folder (checkpoints go here)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args()

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device (use --device cpu --quick)")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := [p for p in parts if p not in "abcd" or len(p) != 1]:
        parser.error(f"unknown parts {unknown}: choose from a, b, c, d")
    if args.dir is not None:
        try:
            args.dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            parser.error(f"--dir {args.dir}: cannot make the folder ({error.strerror})")
    sizes = Sizes.quick() if args.quick else Sizes()
    for name, value in (
        ("rounds", args.rounds),
        ("steps", args.steps),
        ("ckpt_steps", args.ckpt_steps),
        ("every", args.every),
    ):
        if value is not None:
            setattr(sizes, name, value)

    console = Console(width=160)
    log = Console(stderr=True, highlight=False)
    if device.type == "cpu" and not args.quick:
        log.print(
            "[yellow]a CPU run at GPU sizes takes very long: --quick is the CPU smoke test[/yellow]"
        )
    env = environment(device, args.quick)
    scratch = Path(tempfile.mkdtemp(prefix="overlapkit-gpu-bench-", dir=args.dir))
    env["scratch"] = str(scratch)
    env["disk_write_mb_s"] = round(disk_write_mb_s(scratch, (16 if args.quick else 512) << 20))
    header(console, env)
    ctx = Context(device, sizes, scratch, log, args.quick)
    results: dict[str, Any] = {"environment": env, "sizes": asdict(sizes)}
    started = time.perf_counter()
    timings: dict[str, float] = {}
    try:
        for part in parts:
            t0 = time.perf_counter()
            log.print(f"[bold]part ({part})[/bold]")
            if part == "a":
                results["a"] = part_a(ctx)
                print_a(ctx, console, results["a"])
            elif part == "b":
                results["b"] = part_b(ctx, args.auto_max_overhead)
                print_b(ctx, console, results["b"])
            elif part == "c":
                results["c"] = part_c(ctx, args.sample_cost_ms, results.get("a"))
                print_c(ctx, console, results["c"])
            elif part == "d":
                results["d"] = part_d(ctx)
                print_d(ctx, console, results["d"])
            timings[part] = time.perf_counter() - t0
    finally:  # checkpoints are gigabytes: never leave them behind
        shutil.rmtree(scratch, ignore_errors=True)
    total = time.perf_counter() - started
    results["elapsed_s"] = {"total": total, **timings}
    console.print(
        f"elapsed {total:.0f} s ("
        + ", ".join(f"{p}: {t:.0f} s" for p, t in timings.items())
        + ")"
        + ("; target on one GPU: under 480 s" if device.type == "cuda" else "")
    )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
        console.print(f"numbers written to {args.json}")


if __name__ == "__main__":
    main()
