"""What a GPU run relies on, checked on a CPU: lagged step records, the process
group that carries CPU and CUDA collectives, and the refusals before any rank starts."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from conftest import TINY_SCENARIO, cli_here
from overlapkit.optimizations import get_optimization
from overlapkit.runtime.distributed import init_world, pick_device, process_group_backend
from overlapkit.runtime.gpus import (
    GPUFacts,
    GPUSetupError,
    build_has_kernels,
    check_gpu_setup,
    check_precision,
    check_rank_count,
)
from overlapkit.runtime.metrics import PhaseClock
from overlapkit.runtime.steplog import PendingStep, StepLog
from overlapkit.runtime.timing import AsyncScalar, Marks

# ------------------------------------------------------------- lagged records


class LateTiming:
    """A step timing that becomes readable only when the test says so (a GPU's events)."""

    def __init__(self, step_time: float) -> None:
        self.step_time, self.done, self.reads = step_time, False, 0

    def ready(self) -> bool:
        return self.done

    def result(self) -> tuple[float, dict[str, float]]:
        self.reads += 1
        return self.step_time, {"other": self.step_time}


def pending(step: int, timing: LateTiming, loss: float | None = 1.0) -> PendingStep:
    return PendingStep(step=step, rank=0, samples=4, warmup=False, timing=timing, loss=loss)


def test_step_log_yields_records_in_order_once_ready_and_drains_the_rest():
    log = StepLog(max_lag=8)
    timings = [LateTiming(0.1 * (i + 1)) for i in range(4)]
    for i, timing in enumerate(timings):
        log.add(pending(i, timing))
    assert list(log.ready()) == []  # nothing read back yet: no record, no wait
    timings[1].done = True
    assert list(log.ready()) == []  # step 1 is ready but step 0 is not: order is kept
    timings[0].done = True
    assert [r["step"] for r in log.ready()] == [0, 1]
    assert [r["step"] for r in log.drain()] == [2, 3]  # the end reads the rest
    assert len(log) == 0
    assert all(t.reads == 1 for t in timings)


def test_step_log_never_lags_more_than_max_lag_steps():
    log = StepLog(max_lag=2)
    for i in range(3):
        log.add(pending(i, LateTiming(0.1)))
    # Three pending, two allowed: the oldest is read even though it is not ready.
    assert [r["step"] for r in log.ready()] == [0]
    assert len(log) == 2


def test_a_stopped_run_writes_the_steps_the_device_finishes_and_gives_up_on_the_rest(
    tmp_path, monkeypatch
):
    """On a GPU the last few steps' records wait for their events; a run stopped by
    Ctrl-C or SIGTERM wrote none of them to live-steps.jsonl (which `export` reads to
    say how far a stopped run trained). Now it waits for them, a bounded time: a step
    whose collective waits for a peer that is gone never finishes, and a device in
    error has no times to give. (Steps here are made to look unfinished on the device,
    then to finish as the stop waits, or some never, or the device fails.)"""
    from torch import nn

    from overlapkit import Session
    from overlapkit.runtime import session as sessions

    def stopped_after_3_steps(run_dir, device_done):
        finished = {"through": -1}

        def ready(step: PendingStep) -> bool:
            if finished["through"] == "error":
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return step.step <= finished["through"]

        monkeypatch.setattr(PendingStep, "ready", ready)
        session = Session(run_dir=run_dir, warmup_steps=0)
        model = nn.Linear(4, 2)
        batches = [(torch.randn(8, 4), torch.randint(2, (8,))) for _ in range(3)]
        model, optimizer, batches = session.prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.1), batches
        )
        for inputs, targets in session.steps(3):
            with session.forward():
                loss = nn.functional.cross_entropy(model(inputs), targets)
            session.backward(loss)
            session.optimizer_step()
        live = run_dir / "live-steps.jsonl"
        assert not live.exists()  # all three "on the device"
        finished["through"] = device_done
        assert session.stopped() == (3, None)
        assert session.stopped() == (3, None)  # (a second call, as run.py makes, at once)
        if not live.exists():
            return []
        return [json.loads(line)["step"] for line in live.read_text().splitlines()]

    assert stopped_after_3_steps(tmp_path / "a", device_done=2) == [0, 1, 2]
    monkeypatch.setattr(sessions, "STOP_WAIT_S", 0.2)
    assert stopped_after_3_steps(tmp_path / "b", device_done=0) == [0]  # 1 and 2 never
    assert stopped_after_3_steps(tmp_path / "c", device_done="error") == []


def test_a_cpu_clock_is_read_at_once_and_its_phases_sum_to_the_step():
    clock = PhaseClock(torch.device("cpu"))
    clock.start_step()
    clock.switch("forward")
    clock.switch("backward")
    clock.reattribute("backward", "comm_exposed", lambda: 1e9)  # deferred, capped
    timing = clock.close_step()
    assert timing.ready()
    step_time, phases = timing.result()
    assert step_time == pytest.approx(sum(phases.values()))
    assert phases["backward"] == 0.0 and phases["comm_exposed"] > 0


def test_cpu_marks_and_losses_are_host_values():
    marks = Marks(torch.device("cpu"))
    a, b = marks.mark(), marks.mark()
    assert isinstance(a, float) and marks.ready(b) and Marks.seconds(a, b) >= 0
    loss = AsyncScalar(torch.tensor([2.5], requires_grad=True).sum())
    assert loss.ready() and loss.value() == 2.5


def test_the_records_hold_the_losses_the_script_computed(tmp_path):
    """The loss of each step reaches steps.jsonl through `AsyncScalar` and the lagged
    step log: the numbers are the script's, step for step. (On a CPU the scalar is the
    loss itself; tests/test_on_gpu.py checks the GPU's pinned copies the same way.)"""
    from torch import nn

    from overlapkit import Session
    from overlapkit.data import ResumableLoader, ShardedSampler, SyntheticImages

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 16), nn.ReLU(), nn.Linear(16, 4))
    data = SyntheticImages((3, 8, 8), num_classes=4, num_samples=64, seed=0)
    loader = ResumableLoader(data, batch_size=8, sampler=ShardedSampler(len(data), seed=0))
    session = Session(run_dir=tmp_path, warmup_steps=1)
    model, optimizer, loader = session.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loader
    )
    losses = []
    for inputs, targets in session.steps(10):
        with session.forward():
            loss = nn.functional.cross_entropy(model(inputs), targets)
        session.backward(loss)
        session.optimizer_step()
        losses.append(float(loss.detach()))
    session.finish()
    written = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in written] == list(range(10))
    assert [r["loss"] for r in written] == losses
    assert len(set(losses)) == 10  # (steps the test can tell apart)


# ------------------------------------------------------------ process group


def test_nccl_runs_in_a_group_that_also_carries_cpu_collectives():
    assert process_group_backend("nccl") == "cpu:gloo,cuda:nccl"
    assert process_group_backend("gloo") == "gloo"


def test_a_gpu_rank_joins_one_group_bound_to_its_gpu_with_the_environment_set_first(
    monkeypatch,
):
    """Rank 1 of 2 on a machine with 2 GPUs (faked): `init_process_group` gets the group
    that carries CPU collectives too, the rank's own GPU as ``device_id``, and finds
    NCCL's variables already set (a communicator reads them as it starts)."""
    from overlapkit.runtime import distributed

    seen: dict = {}

    def init_process_group(backend, **kwargs):
        seen.update(kwargs, backend=backend, nccl_algo=os.environ.get("NCCL_ALGO"))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: seen.update(current=device))
    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)
    monkeypatch.setattr(distributed, "settle_at_exit", lambda: None)
    for name, value in {"RANK": 1, "WORLD_SIZE": 2, "LOCAL_RANK": 1, "LOCAL_WORLD_SIZE": 2}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("NCCL_ALGO", "unset")  # (restored afterwards)
    world = init_world("auto", environment=lambda b: {"NCCL_ALGO": "Ring"} if b == "nccl" else {})
    assert world.backend == "nccl" and world.device == torch.device("cuda", 1)
    assert seen["backend"] == "cpu:gloo,cuda:nccl"
    assert seen["device_id"] == torch.device("cuda", 1) == seen["current"]
    assert (seen["rank"], seen["world_size"]) == (1, 2)
    assert seen["nccl_algo"] == "Ring"  # set before the group started


def test_ddp_overlap_asks_for_nccl_variables_only_on_nccl():
    ddp = get_optimization("ddp_overlap")(1.0, nccl_algo="ring", nccl_proto="ll128")
    assert ddp.environment("nccl") == {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL128"}
    assert ddp.environment("gloo") == {}
    assert get_optimization("ddp_overlap")(1.0).environment("nccl") == {}


# ------------------------------------------------------- refusals before start

V100 = GPUFacts(8, "Tesla V100-SXM2-16GB", (7, 0), ("sm_75", "sm_80", "sm_86", "sm_90"))
V100_CU126 = GPUFacts(
    8, "Tesla V100-SXM2-16GB", (7, 0), ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80")
)
H100 = GPUFacts(1, "NVIDIA H100", (9, 0), ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100"))


def test_more_ranks_than_gpus_is_refused_with_both_counts():
    check_rank_count(4, 4)
    with pytest.raises(GPUSetupError, match=r"2 ranks on this machine but 1 visible GPU"):
        check_rank_count(2, 1)
    with pytest.raises(GPUSetupError, match="2 ranks .* 1 visible"):
        check_gpu_setup(2, "fp32", H100)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_pick_device_never_shares_or_invents_a_gpu(monkeypatch):
    with pytest.raises(GPUSetupError, match="no CUDA device"):
        pick_device("cuda", 0)
    # Local rank 1 on a machine with one GPU: refused (local_rank % count shared GPU 0).
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pick_device("cuda", 0) == torch.device("cuda", 0)
    with pytest.raises(GPUSetupError, match="2 ranks on this machine but 1 visible GPU"):
        pick_device("cuda", 1)


def test_bf16_below_compute_capability_8_is_refused_naming_fp16():
    check_precision("bf16", (8, 0))
    check_precision("fp16", (7, 0))
    with pytest.raises(GPUSetupError, match=r"bf16 .* 7\.0: use fp16"):
        check_precision("bf16", (7, 0), "Tesla V100")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.precision=fp16"], "train.precision fp16 is for GPUs only"),
        (["world.backend=nccl"], "world.backend nccl is for GPUs only"),
        (["world.backend=nccl", "world.nprocs=2"], "world.backend nccl is for GPUs only"),
    ],
)
def test_fp16_or_nccl_on_a_machine_without_gpus_is_refused_before_any_rank_starts(
    tiny_scenario, tmp_path, monkeypatch, capsys, overrides, message
):
    from overlapkit.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without GPUs
    sets = [arg for override in overrides for arg in ("--set", override)]
    for command in (["check"], ["run", "--out", str(tmp_path / "run")]):
        assert main([command[0], str(tiny_scenario()), *command[1:], *sets]) == 2
        err = capsys.readouterr().err.replace("\n", " ")
        assert f"error: {message}" in err and "CPU" in err, err
        assert "Traceback" not in err and "internal error" not in err
    assert not (tmp_path / "run").exists()  # refused before the run folder, before any rank


def test_a_build_without_the_gpus_kernels_is_refused_naming_gpu_capability_and_arches():
    with pytest.raises(GPUSetupError) as error:
        check_gpu_setup(1, "fp32", V100)
    message = str(error.value)
    assert "Tesla V100-SXM2-16GB" in message and "7.0" in message
    assert "sm_75, sm_80" in message and "cu126" in message
    check_gpu_setup(1, "fp32", H100)


@pytest.mark.parametrize(
    ("facts", "overrides", "message"),
    [
        (
            V100_CU126,
            ["train.precision=bf16"],
            r"bf16 needs .* Tesla V100-SXM2-16GB has 7\.0: use fp16",
        ),
        (V100_CU126, ["world.nprocs=9"], r"9 ranks on this machine but 8 visible GPU\(s\)"),
        (V100, [], r"no kernels for Tesla V100-SXM2-16GB \(compute capability 7\.0\): .*sm_75"),
    ],
)
def test_check_and_run_refuse_what_this_gpu_machine_cannot_run_before_any_rank_starts(
    tiny_scenario, tmp_path, monkeypatch, facts, overrides, message
):
    """The rules above, as `check` and `run` apply them to what torch finds (faked
    here: a machine of 8 V100s, with or without a build that has their kernels)."""

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(GPUFacts, "probe", classmethod(lambda cls: facts))
    sets = [a for o in ["world.device=cuda", *overrides] for a in ("--set", o)]
    for command in (["check"], ["run", "--out", str(tmp_path / "run")]):
        done = cli_here(command[0], tiny_scenario(), *command[1:], *sets)
        said = " ".join(done.stderr.split())
        assert done.returncode == 2 and re.search(message, said), said
        assert "Traceback" not in said and "internal error" not in said
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("capability", "arches", "runs"),
    [
        ((7, 0), ("sm_70", "sm_80"), True),
        ((7, 0), ("sm_75", "sm_80"), False),  # a newer minor's cubin does not run on 7.0
        ((8, 6), ("sm_80",), True),  # same major, older minor: binary compatible
        ((9, 0), ("sm_80", "sm_86"), False),  # no cubin for major 9 and no PTX
        ((9, 0), ("sm_80", "compute_80"), True),  # PTX is compiled at load time
        ((12, 0), ("sm_90a", "sm_100", "sm_120"), True),
        ((9, 0), ("sm_90a",), True),
        ((9, 1), ("sm_90a",), False),  # an arch-specific cubin runs on that capability only
        ((12, 0), ("compute_90a",), False),  # arch-specific PTX too
        ((10, 3), ("compute_100f",), True),  # family-specific PTX: its major, newer minors
        ((12, 0), ("compute_100f",), False),
        ((7, 0), ("compute_75",), False),  # PTX for a newer GPU does not run on an older one
    ],
)
def test_which_builds_run_on_which_gpus(capability, arches, runs):
    assert build_has_kernels(capability, arches) is runs


# ------------------------------------------- the clock on a (simulated) GPU


class FakeDevice:
    """A device timeline: events complete only when the test lets the device run."""

    def __init__(self) -> None:
        self.now = 0.0
        self.pending: list[FakeEvent] = []
        self.waits = 0  # host waits for the device (synchronize on an unfinished event)

    def run(self, seconds: float) -> None:
        for event in self.pending:
            event.time = self.now = self.now + seconds
        self.pending.clear()


class FakeEvent:
    """As strict as a CUDA event: ``elapsed_time`` needs both events made with
    ``enable_timing``, recorded and completed (CUDAEvent::elapsed_time raises
    otherwise); ``query`` of an event never recorded is True."""

    device: FakeDevice

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self.recorded = False
        self.time: float | None = None

    def record(self, stream=None) -> None:
        self.recorded = True
        self.time = None
        self.device.pending.append(self)

    def query(self) -> bool:
        return not self.recorded or self.time is not None

    def synchronize(self) -> None:
        if self.recorded and self.time is None:
            self.device.waits += 1
            self.device.run(0.001)

    def elapsed_time(self, end: FakeEvent) -> float:
        for event in (self, end):
            if not event.enable_timing:
                raise RuntimeError("Both events must be created with argument 'enable_timing=True'")
            if event.time is None:
                raise RuntimeError("Both events must be recorded and completed")
        return (end.time - self.time) * 1000.0


def test_on_a_gpu_the_clock_never_waits_for_the_device_and_records_arrive_later(monkeypatch):
    device = FakeDevice()
    FakeEvent.device = device
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    clock = PhaseClock(torch.device("cuda", 0))
    log = StepLog(max_lag=4)
    records = []
    for step in range(6):
        clock.start_step()
        clock.switch("forward")
        clock.switch("backward")
        clock.switch("other")
        log.add(pending(step, clock.close_step(), loss=0.5))
        records += log.ready()
        if step >= 1:
            device.run(0.010)  # the device finishes what was queued a step ago, meanwhile
    assert device.waits == 0  # no synchronisation on the hot path
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]  # lagged, in order
    records += log.drain()
    assert [r["step"] for r in records] == list(range(6))
    for record in records:
        assert record["step_time_s"] == pytest.approx(sum(record["phases_s"].values()))
        assert record["step_time_s"] > 0
    # Events go back to the pool: those of the few steps in flight, not four per step (25).
    assert clock.marks.created <= 16


def test_on_nccl_a_buckets_all_reduce_is_timed_on_the_device_without_a_wait(monkeypatch):
    """NCCL's hook future completes as soon as the all-reduce is queued, and its
    callback runs at once: a host clock there would time the queueing. The bucket
    timer's marks are CUDA events, which time the work on the device, read once the
    device did it. (Here a simulated device whose clock moves 10 ms at each event it
    reaches, launch marks included: busy spans four of them.)"""
    from overlapkit.optimizations.ddp_overlap.hooks import BucketTimer, SyncTiming

    device = FakeDevice()
    FakeEvent.device = device
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    marks = Marks(torch.device("cuda", 0))

    class Bucket:
        def __init__(self, index: int, numel: int) -> None:
            self._index, self._buffer = index, torch.zeros(numel)

        def index(self) -> int:
            return self._index

        def buffer(self) -> torch.Tensor:
            return self._buffer

    def nccl_like(state, bucket):  # its future is done when the work is queued
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    timer = BucketTimer(nccl_like, marks)
    for index, numel in enumerate((1000, 250)):
        timer.hook(None, Bucket(index, numel)).wait()
    timing = SyncTiming(timer.calls, marks)
    assert not timing.ready()  # queued, not done: nothing to read yet
    device.run(0.010)  # the device runs each queued all-reduce, in order
    assert timing.ready()
    exposed, busy, calls = timing.values()
    assert exposed == pytest.approx(0.010) and busy == pytest.approx(0.030)
    assert calls == [(4000, pytest.approx(0.010)), (1000, pytest.approx(0.010))]
    assert device.waits == 0


def test_every_summary_records_the_machines_it_ran_on(tmp_path, monkeypatch):
    """Machines are told apart by host name and boot id: VMs cloned from one image
    share a host name (its ranks' GPUs, and the summary's machines, were taken as
    one machine's)."""
    import socket

    from overlapkit.runtime import hardware
    from overlapkit.runtime.hardware import describe_node, nodes_of, this_machine

    boot = Path("/proc/sys/kernel/random/boot_id")
    if boot.exists():  # the same machine in every process: no per-process part
        assert this_machine() == f"{socket.gethostname()} {boot.read_text().strip()}"
    node = describe_node(torch.device("cpu"))
    assert node["cpu_cores"] >= 1 and node["torch"] == torch.__version__
    assert node["device"] == "cpu" and node["gpus"] == []
    monkeypatch.setattr(hardware, "BOOT_ID", tmp_path / "boot_id")
    hardware.BOOT_ID.write_text("booted elsewhere\n")
    clone = describe_node(torch.device("cpu"))  # the same host name, another machine
    assert clone["host"] == node["host"] and clone["machine"] != node["machine"]
    other = {**node, "host": "elsewhere", "machine": "elsewhere 1"}
    nodes = nodes_of([node, node, other, clone])
    assert [n["ranks"] for n in nodes] == [[0, 1], [2], [3]]
    assert [n["host"] for n in nodes] == [node["host"], "elsewhere", node["host"]]
    assert all("machine" not in n for n in nodes)


def test_the_grad_scalers_state_is_saved_as_tensors_and_resumes_exactly():
    """`GradScaler.state_dict` reads the scale with ``.item()``: on a GPU every checkpoint
    would wait for the device. The precision's state keeps them as tensors (copied:
    the next update must not change what was saved) and loads them back exactly. On a
    CPU with torch's CPU grad scaler, the same code."""
    from overlapkit.runtime.precision import Precision

    def with_scaler() -> Precision:
        precision = Precision("fp32", torch.device("cpu"))
        precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        return precision

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    precision = with_scaler()
    assert precision.state_dict()["scale"] == 2.0**10  # before any step: the plain numbers
    for factor in (1.0, float("inf"), 1.0, 1.0, 1.0):  # one skipped step, then growth
        optimizer.zero_grad()
        precision.backward((weight * factor).sum())
        precision.step(optimizer)
    expected = precision.scaler.state_dict()
    saved = precision.state_dict()
    assert isinstance(saved["scale"], torch.Tensor)
    assert isinstance(saved["_growth_tracker"], torch.Tensor)
    precision.backward((weight * float("inf")).sum())  # changes the live scale...
    precision.step(optimizer)
    assert precision.scaler.get_scale() != expected["scale"]  # (the test can tell)
    resumed = with_scaler()
    resumed.load_state_dict(saved)  # ...not the saved one
    assert resumed.scaler.state_dict() == expected


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_the_built_in_loops_optimizer_is_fused_on_a_gpu(name):
    """Fused, its step takes fp16's inf check on the device (an unfused one makes
    `GradScaler.step` read it on the host every step), and is one kernel a group."""
    from overlapkit.runtime.loop import OptimizerConfig, build_optimizer
    from overlapkit.runtime.precision import scaler_wait_note

    model = torch.nn.Linear(3, 2)
    on_gpu = build_optimizer(OptimizerConfig(name=name), model, torch.device("cuda", 0))
    assert on_gpu.defaults["fused"] is True and scaler_wait_note(on_gpu) is None
    on_cpu = build_optimizer(OptimizerConfig(name=name), model, torch.device("cpu"))
    assert not on_cpu.defaults.get("fused")


def test_fp16_with_an_unfused_optimizer_is_told_the_scaler_waits_for_the_gpu():
    """GradScaler.step reads the inf check on the host (``.item()``) unless the
    optimizer takes it on the device (a fused one): a ported script's own SGD made
    every fp16 step wait for the GPU, unsaid. (Session(precision="fp16") needs a GPU:
    tests/test_on_gpu.py sees the note in a run.)"""
    from overlapkit.runtime.precision import scaler_wait_note

    params = [torch.nn.Parameter(torch.ones(2))]
    for unfused in (torch.optim.SGD(params, lr=0.1), torch.optim.AdamW(params, foreach=True)):
        said = scaler_wait_note(unfused)
        assert said is not None and type(unfused).__name__ in said and "fused=True" in said
    for fused in (
        torch.optim.SGD(params, lr=0.1, fused=True),
        torch.optim.Adam(params, fused=True),
    ):
        assert scaler_wait_note(fused) is None


# ------------------------------------- no value read on the host (a CPU stand-in)


TINY_BERT = """
name: tinybert
model: {name: bert, vocab_size: 200, hidden: 16, layers: 2, heads: 2, max_len: 32, num_classes: 2}
data: {name: synthetic-tokens, seq_len: 16, vocab_size: 200, num_classes: 2, num_samples: 64, eval_samples: 16}
train: {batch_size: 4, steps: 4, warmup_steps: 1, optimizer: {name: adamw, lr: 0.001}, seed: 0}
world: {nprocs: 1}
"""


@pytest.mark.parametrize(
    ("model", "ranks", "overrides"),
    [
        ("resnet", 1, ["optimizations.checkpoint.every=2"]),
        ("resnet", 1, ["optimizations.prefetch.intensity=1", "optimizations.prefetch.workers=1"]),
        (
            "bert",
            1,
            [
                "optimizations.checkpoint.every=2",
                "train.precision=bf16",
                "train.lr_schedule.name=linear",
                "train.lr_schedule.warmup_steps=2",
            ],
        ),
        pytest.param(
            "resnet",
            2,
            ["optimizations.ddp_overlap.intensity=1", "optimizations.checkpoint.every=2"],
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "resnet",
            2,
            ["optimizations.pipeline.stages=2", "optimizations.pipeline.microbatches=2"],
            marks=pytest.mark.slow,
        ),
    ],
)
def test_no_step_reads_a_tensors_value_on_the_host(tmp_path, model, ranks, overrides):
    """The built-in loop, its `Session` and the optimizations' per-step hooks never read
    a value of the step's tensors on the host, on any rank (the built-in BERT asked at
    every forward whether its batch held padding: on a GPU, a wait for the device each
    time). The evaluation reads its sums once. (tests/plugins/host_reads.py)"""
    from host_reads import reads_of_a_run

    from overlapkit.launch.local import launch_local

    text = (TINY_BERT if model == "bert" else TINY_SCENARIO).replace(
        "world: {nprocs: 1}", f"world: {{nprocs: {ranks}}}"
    )
    sets = [*overrides, "train.eval.at_end=true", f"optimizations.checkpoint.dir={tmp_path}/ck"]
    if not any(o.startswith("optimizations.checkpoint") for o in overrides):
        sets.pop()
    if ranks == 1:
        each = {0: reads_of_a_run(text, sets, str(tmp_path))}
    else:
        each = launch_local(reads_of_a_run, ranks, text, sets, str(tmp_path))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == (4 if model == "bert" else 6) and "accuracy" in summary["eval"]
    for rank, reads in each.items():
        assert reads["in_steps"] == [], f"rank {rank}: " + "\n".join(reads["in_steps"][:5])
        assert len(reads["in_evaluation"]) == 1, reads["in_evaluation"][:5]  # its sums
