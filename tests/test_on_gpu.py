"""On a real CUDA GPU: the paths CI (which has none) tests only with fakes.

Skipped without a GPU. On a machine with one: ``python -m pytest tests/test_on_gpu.py``
(with ``benchmarks/gpu.py`` for the speed targets).
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.nn.functional as F
import yaml
from rank_programs import mlp
from torch import nn

from conftest import TINY_SCENARIO, run_cli
from overlapkit import Session, get_optimization
from overlapkit.data import ResumableLoader, ShardedSampler, SyntheticImages
from overlapkit.optimizations.pipeline.profile import profile_layers
from overlapkit.runtime.rng import seed_everything

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.slow,
]

Checkpoint = get_optimization("checkpoint")
Prefetch = get_optimization("prefetch")


def train(run_dir, steps, *, optimizations=(), precision="fp32", strict_from=None, warmup=2):
    """One rank on the GPU, the test MLP with dropout (the CUDA RNG matters), fused SGD
    with momentum. From step ``strict_from`` on, any call that synchronises the host
    with the device raises (`torch.cuda.set_sync_debug_mode`)."""
    seed_everything(0)
    model = nn.Sequential(mlp(), nn.Dropout(0.1))
    data = SyntheticImages((3, 8, 8), num_classes=4, num_samples=256, seed=0)
    loader = ResumableLoader(data, 32, ShardedSampler(len(data), seed=0))
    session = Session(
        list(optimizations),
        device="cuda",
        precision=precision,
        warmup_steps=warmup,
        run_dir=run_dir,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)
    model, optimizer, loader = session.prepare(model, optimizer, loader)
    losses = []
    try:
        for inputs, targets in session.steps(steps):
            if session.state.step == strict_from:
                torch.cuda.set_sync_debug_mode("error")
            assert inputs.is_cuda and targets.is_cuda
            with session.forward():
                loss = F.cross_entropy(model(inputs), targets)
            session.backward(loss)
            session.optimizer_step()
            losses.append(loss.detach())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    summary = session.finish()
    return [float(x) for x in losses], model, summary


@contextlib.contextmanager
def one_rank_nccl_group():
    """The group overlapkit starts under nccl (`cpu:gloo,cuda:nccl`, bound to GPU 0),
    of one rank, started by the caller (as under Ray Train), closed after the block."""
    import torch.distributed as dist

    from conftest import free_port
    from overlapkit.runtime.distributed import process_group_backend

    dist.init_process_group(
        process_group_backend("nccl"),
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


@pytest.mark.parametrize(
    ("precision", "optimization"),
    [
        ("fp32", None),
        ("bf16", None),
        ("fp16", None),
        ("fp32", "checkpoint"),
        ("fp16", "checkpoint"),  # the grad scaler's state is saved without a read
        ("fp32", "prefetch"),
    ],
)
def test_steps_never_synchronise_the_host_with_the_gpu(tmp_path, precision, optimization):
    if precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("bf16 needs compute capability 8.0")
    made = {"checkpoint": lambda: Checkpoint(every=3), "prefetch": lambda: Prefetch(1.0)}
    optimizations = [made[optimization]()] if optimization else []
    losses, _, summary = train(
        tmp_path, 30, optimizations=optimizations, precision=precision, strict_from=5
    )
    assert len(losses) == 30 and all(x == x for x in losses)  # no NaN
    assert summary["steps"] == 28  # all measured steps are in the summary
    # The losses came through pinned copies read steps later: still the script's.
    written = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in written] == losses
    if optimization == "checkpoint":
        assert summary["optimizations"]["checkpoint"]["checkpoints"] >= 9


def test_fp16_with_an_unfused_optimizer_says_each_step_waits(tmp_path):
    session = Session([], device="cuda", precision="fp16", run_dir=tmp_path)
    model = mlp()
    session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05), None)
    assert any("is not fused" in note for note in session.notes), session.notes


def test_the_clock_never_waits_for_work_the_gpu_has_not_reached(tmp_path, monkeypatch):
    # A small model: the device finishes each step long before the host queues the
    # next, so every event the clock reads has completed when it reads it.
    early, draining = [], []
    synchronize, finish = torch.cuda.Event.synchronize, Session.finish

    def watched(event):
        if not draining:  # finish() reads the last steps at once: those may still run
            early.append(not event.query())
        synchronize(event)

    def drained(session):
        draining.append(True)
        return finish(session)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", watched)
    monkeypatch.setattr(Session, "finish", drained)
    losses, _, summary = train(tmp_path, 40, strict_from=None)
    assert len(losses) == 40 and summary["steps"] == 38
    assert len(early) > 0 and sum(early) <= 2, f"{sum(early)} of {len(early)} reads waited"


def test_a_run_resumed_on_the_gpu_matches_one_never_stopped(tmp_path):
    straight, straight_model, _ = train(tmp_path / "a", 14, optimizations=[Checkpoint(every=3)])
    first, _, _ = train(tmp_path / "b", 7, optimizations=[Checkpoint(every=3, final=False)])
    rest, model, summary = train(tmp_path / "b", 14, optimizations=[Checkpoint(every=3)])
    section = summary["optimizations"]["checkpoint"]
    assert section["resumed_from_step"] == 6
    assert first[:6] + rest == straight  # step 6 ran again from the checkpoint before it
    assert torch.equal(params(model), params(straight_model))
    assert section["pinned_bytes"] >= section["host_buffer_bytes"] > 0  # pinned, and held


def scenario(tmp_path, **changes):
    spec = yaml.safe_load(TINY_SCENARIO)
    for key, value in changes.items():
        section, name = key.split("__")
        spec[section][name] = value
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_nccl_run_evaluates_and_checkpoints(tmp_path):
    path = scenario(tmp_path, world__backend="nccl", world__device="cuda")
    spec = yaml.safe_load(path.read_text())
    spec["train"]["eval"] = {"every": 3, "at_end": True}  # evaluation sums on the device
    spec["optimizations"] = {"checkpoint": {"every": 2}}
    path.write_text(yaml.safe_dump(spec))
    result = run_cli("run", path, "--out", tmp_path / "run", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [run["samples"] for run in summary["eval"]["runs"]] == [64] * len(
        summary["eval"]["runs"]
    )
    assert len(summary["eval"]["runs"]) >= 3
    assert summary["optimizations"]["checkpoint"]["checkpoints"] >= 2


def test_a_session_in_a_nccl_group_evaluates_and_checkpoints(tmp_path):
    """The group overlapkit starts under nccl (`cpu:gloo,cuda:nccl`, bound to the
    rank's GPU), here of one rank and started first, as under Ray Train: evaluation
    sums on the device, checkpoints coordinate, the group closes. (A one-rank run
    through the CLI starts no group at all.)"""
    import torch.distributed as dist

    with one_rank_nccl_group():
        seed_everything(0)
        data = SyntheticImages((3, 8, 8), num_classes=4, num_samples=128, seed=0)
        loader = ResumableLoader(data, 32, ShardedSampler(len(data), seed=0))
        session = Session([Checkpoint(every=2)], device="cuda", run_dir=tmp_path)
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, fused=True)
        model, optimizer, loader = session.prepare(model, optimizer, loader)
        assert session.world.backend == "nccl"
        for inputs, targets in session.steps(6):
            with session.forward():
                loss = F.cross_entropy(model(inputs), targets)
            session.backward(loss)
            session.optimizer_step()
        result = session.evaluate(ResumableLoader(data, 32, ShardedSampler(len(data), seed=1)))
        summary = session.finish()
        assert result["samples"] == 128
        assert summary["optimizations"]["checkpoint"]["checkpoints"] >= 3
        dist.barrier()  # the group is still the caller's, and works


def test_the_collectives_overlapkit_uses_run_on_its_nccl_group():
    """The runtime's collectives skip a one-rank world, so the session test above
    sends nothing through NCCL: here each kind the runtime uses runs on the group it
    starts (`cpu:gloo,cuda:nccl`, bound to the GPU): device tensors (evaluation's
    sums), CPU tensors (the checkpoint vote), objects (checksums, the partition), a
    gloo subgroup (a checkpoint's own groups) and a barrier."""
    import torch.distributed as dist

    device = torch.device("cuda", 0)
    with one_rank_nccl_group():
        on_device = torch.tensor([2.0, 3.0], dtype=torch.float64, device=device)
        dist.all_reduce(on_device)
        on_host = torch.tensor([5], dtype=torch.int64)
        dist.all_reduce(on_host, op=dist.ReduceOp.MAX)
        gathered = [None]
        dist.all_gather_object(gathered, {"crc32c": "0a1b2c3d"})
        sent = [{"split": [0, 3, 7]}]
        dist.broadcast_object_list(sent, src=0)
        own = dist.new_group([0], backend="gloo")
        pieces = [torch.zeros(1)]
        dist.all_gather(pieces, torch.ones(1), group=own)
        dist.barrier()
        torch.cuda.synchronize()
        assert on_device.tolist() == [2.0, 3.0] and on_host.item() == 5
        assert gathered == [{"crc32c": "0a1b2c3d"}] and sent == [{"split": [0, 3, 7]}]
        assert pieces[0].item() == 1.0


def test_the_step_times_are_the_devices_while_the_host_runs_ahead(tmp_path):
    """On a model the GPU is the bottleneck of, the host queues steps ahead of the
    device (no step waits for it), yet the step times in steps.jsonl, read from CUDA
    events, add up to the wall clock of the measured steps (within 5 %), not to the
    host's time to queue them."""
    import time

    from overlapkit import Optimization

    device = torch.device("cuda", 0)
    marks: dict[str, float] = {}

    class Window(Optimization):
        name = "test_window"

        def on_step_start(self, state):
            if state.step == state.warmup_steps and "start" not in marks:
                torch.cuda.synchronize(device)
                marks["start"] = time.perf_counter()

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(6)]).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6, fused=True)
    batch = torch.randn(4096, 4096, device=device)
    session = Session([Window()], device="cuda", warmup_steps=5, run_dir=tmp_path)
    model, optimizer, batches = session.prepare(model, optimizer, [batch] * 4)
    for inputs in session.steps(45):
        with session.forward():
            loss = model(inputs).square().mean()
        session.backward(loss)
        session.optimizer_step()
    queued = time.perf_counter()  # the host is done queueing; the device is not
    torch.cuda.synchronize(device)
    wall = time.perf_counter() - marks["start"]
    summary = session.finish()
    records = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    measured = [r for r in records if not r["warmup"]]
    assert len(measured) == summary["steps"] == 40
    total = sum(r["step_time_s"] for r in measured)
    assert abs(total - wall) <= 0.05 * wall, (total, wall)
    for r in measured:  # the phases still add up to each step
        assert abs(sum(r["phases_s"].values()) - r["step_time_s"]) <= 0.03 * r["step_time_s"]
    assert queued - marks["start"] < 0.5 * wall  # the host ran ahead of the device


def test_bucket_timing_on_nccl_reads_cuda_events_of_the_work():
    """The exposed-communication figure on NCCL: DDP's buckets, timed by the comm
    hook's CUDA events (launch on the backward's stream, completion in the future's
    callback, whose streams wait for the all-reduce), read after the work without
    an error, in the order the buckets ran, from a pool of events reused."""
    from torch.nn.parallel import DistributedDataParallel

    from overlapkit.optimizations.ddp_overlap.hooks import BucketTimer, SyncTiming, make_hook
    from overlapkit.runtime.timing import Marks

    device = torch.device("cuda", 0)
    with one_rank_nccl_group():
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).to(device)
        ddp = DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=4)
        marks = Marks(device)
        state, hook = make_hook("none", {}, None)
        timer = BucketTimer(hook, marks)
        ddp.register_comm_hook(state, timer.hook)
        for _ in range(4):
            timer.calls = []
            ddp(torch.randn(256, 1024, device=device)).sum().backward()
            timing = SyncTiming(timer.calls, marks)
            torch.cuda.synchronize()
            assert timing.ready()
            exposed, busy, calls = timing.values()  # gives its events back to the pool
            assert len(calls) >= 2 and all(latency >= 0 for _, latency in calls)
            assert 0 <= exposed <= busy
        assert marks.created == 2 * len(calls)  # the first step's events, reused since


def test_a_deterministic_resnet_run_on_the_gpu_repeats_itself(tmp_path):
    """``train.deterministic`` on CUDA: the built-in ResNet has no operation torch
    refuses there (adaptive pooling's backward was one), and two runs agree."""
    path = scenario(tmp_path, world__device="cuda", train__deterministic=True)
    runs = []
    for name in ("a", "b"):
        result = run_cli("run", path, "--out", tmp_path / name, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert any("deterministic on a GPU" in note for note in summary["notes"])
        runs.append(summary["final_loss"])
    assert runs[0] == runs[1]


def test_more_ranks_than_gpus_is_refused_before_any_rank_starts(tmp_path):
    gpus = torch.cuda.device_count()
    path = scenario(tmp_path, world__nprocs=gpus + 1, world__backend="nccl")
    result = run_cli("run", path, "--out", tmp_path / "run", timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert str(gpus + 1) in result.stderr and str(gpus) in result.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


def test_the_layer_profile_times_compute_not_kernel_launches():
    # One large matmul against one tiny: their launches cost the same, their work not.
    device = torch.device("cuda", torch.cuda.current_device())
    layers = [("large", nn.Linear(4096, 4096)), ("small", nn.Linear(4096, 8))]
    layers = [(name, layer.to(device)) for name, layer in layers]  # as the model is, prepared
    costs = profile_layers(layers, torch.randn(8192, 4096, device=device), device)
    large, small = (c.compute_s for c in costs)
    assert large > 5 * small, (large, small)
