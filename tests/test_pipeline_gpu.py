"""The pipeline on GPUs, checked on a CPU: set-ups that cannot work are refused before
any rank starts, the set-up probes use the rank's device (and wait for it), and the
stages' times are marks read after the step, never a wait for the device inside it."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from overlapkit import get_optimization
from overlapkit.cli import main
from overlapkit.optimizations.pipeline import PipelineError
from overlapkit.optimizations.pipeline import profile as profile_module
from overlapkit.optimizations.pipeline.profile import measure_link, profile_layers
from overlapkit.optimizations.pipeline.stage import StepMeter, TimedStage
from overlapkit.runtime import Scheduler, timing
from overlapkit.runtime.distributed import World
from overlapkit.runtime.metrics import PhaseClock

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def pipeline(**settings):
    return get_optimization("pipeline")(**settings)


def world(device=CPU, world_size=2):
    return World(0, world_size, 0, world_size, device, "gloo")


# ---------------------------------------------------------------- refusals
def test_gloo_cannot_carry_a_pipeline_between_gpus():
    with pytest.raises(PipelineError, match="gloo cannot send CUDA tensors.*nccl, or auto"):
        pipeline().check(2, "cuda", "gloo")
    pipeline().check(2, "cuda", "nccl")
    pipeline().check(2, "cpu", "gloo")


def test_fp16_under_a_pipeline_is_refused_with_the_alternatives():
    with pytest.raises(PipelineError, match="cannot train in fp16.*use bf16 .* or fp32"):
        Scheduler([pipeline()]).check(2, "cuda", "nccl", precision="fp16")
    for precision in ("fp32", "bf16"):
        Scheduler([pipeline()]).check(2, "cuda", "nccl", precision=precision)


def test_a_session_passes_its_precision_to_the_checks():
    from overlapkit.runtime import Session

    with pytest.raises(PipelineError, match="cannot train in fp16"):
        Session([pipeline()], world=world(), precision="fp16")


GPU_SCENARIO = """
name: pipeline-on-gpus
model: {name: resnet18, stem: cifar, num_classes: 4, width: 4}
data: {name: synthetic-images, shape: [3, 16, 16], num_classes: 4, num_samples: 64}
train: {batch_size: 8, steps: 2}
world: {nprocs: 2, device: cuda}
optimizations:
  pipeline: {split: equal, microbatches: 2}
"""


@pytest.mark.parametrize(
    "override, message",
    [
        ("world.backend=gloo", "gloo cannot send CUDA tensors"),
        ("train.precision=fp16", "cannot train in fp16"),
    ],
)
def test_check_refuses_a_pipeline_that_would_fail_on_gpus(
    tiny_scenario, monkeypatch, capsys, override, message
):
    from overlapkit.runtime import gpus

    # This machine has no GPU: the scenario's own GPU checks see two that can run it.
    monkeypatch.setattr(gpus.GPUFacts, "probe", classmethod(lambda cls: cls(2, "GPU", (9, 0))))
    path = tiny_scenario(GPU_SCENARIO)
    assert main(["check", str(path)]) == 0
    capsys.readouterr()
    assert main(["check", str(path), "--set", override]) == 2
    assert message in capsys.readouterr().err.replace("\n", " ")


# ---------------------------------------------------------------- set-up probes
def test_the_link_probe_sends_tensors_on_the_device_it_is_given(monkeypatch):
    devices = []
    monkeypatch.setattr(profile_module.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(profile_module.dist, "send", lambda t, dst: devices.append(t.device))
    monkeypatch.setattr(profile_module.dist, "recv", lambda t, src: devices.append(t.device))
    assert measure_link(0, 1, torch.device("meta"), nbytes=1024, repeats=2) > 0
    assert len(devices) == 2 * 3 and {d.type for d in devices} == {"meta"}


def test_the_layer_profile_waits_for_the_gpu_around_each_timing(monkeypatch):
    waits = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))
    layers = [("a", nn.Linear(4, 4)), ("b", nn.Linear(4, 2))]
    profile_layers(layers, torch.randn(3, 4), CPU, repeats=2)
    assert waits == []
    costs = profile_layers(layers, torch.randn(3, 4), CUDA, repeats=2)
    assert [c.name for c in costs] == ["a", "b"]
    assert waits == [CUDA] * (2 * 3 * 2)  # before and after each run, warm-up included


# ---------------------------------------------------------------- step times
# One step of a stage, in seconds (powers of two: every sum is exact): a wait for the
# first activation, micro-batches with gaps between them, a wait at the end.
FORWARD = (0.25, 0.125, 0.25, 0.125)
BACKWARD = (0.5, 0.25, 0.5, 0.25)  # input gradients
WEIGHT = (0.125,) * 4  # weight gradients
GAP, FIRST_WAIT, LAST_WAIT = 0.0625, 0.5, 0.25
EXPECTED = {
    "step_s": 3.75,
    "forward_s": 0.75,
    "backward_s": 2.0,
    "last_backward_s": 0.25 + 0.125,
    "bubble_s": FIRST_WAIT + 4 * GAP + LAST_WAIT,
    "sent_bytes": 4 * 2 * 4 * 4,  # each micro-batch's 2x4 float32 output, sent on
}


class FakeClock:
    """The host's clock, moved on by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeSchedule:
    """Runs one stage's micro-batches as a schedule would, taking the times above."""

    def __init__(self, stage: TimedStage, clock: FakeClock) -> None:
        self.stage, self.clock = stage, clock

    def step(self, *args, target=None, losses=None, return_outputs=True) -> None:
        self.clock.now += FIRST_WAIT
        for chunk in range(len(FORWARD)):
            self.stage.forward_one_chunk(chunk, args)
            self.clock.now += GAP
        last = len(BACKWARD) - 1
        for chunk in range(len(BACKWARD)):
            self.stage.backward_one_chunk(chunk, last_backward=chunk == last)
            self.stage.backward_weight_one_chunk(chunk, last_backward=chunk == last)
        self.clock.now += LAST_WAIT


@pytest.fixture
def clock(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(timing, "perf_counter", clock)

    def run(seconds, output=None):
        def chunk(self, index, *args, **kwargs):
            clock.now += seconds[index]
            return output

        return chunk

    monkeypatch.setattr(PipelineStage, "forward_one_chunk", run(FORWARD, torch.zeros(2, 4)))
    monkeypatch.setattr(PipelineStage, "backward_one_chunk", run(BACKWARD))
    monkeypatch.setattr(PipelineStage, "backward_weight_one_chunk", run(WEIGHT))
    return clock


def timed_pipeline(device: torch.device, clock: FakeClock):
    """A pipeline's first stage of two, past its first step, on a fake schedule."""
    pipe = pipeline(microbatches=4)
    pipe.microbatches, pipe.batch, pipe.stage_ids = 4, 8, [0]
    pipe.meter = StepMeter(device)
    stage = TimedStage.__new__(TimedStage)  # the timing only: no process group
    stage.stage_index, stage.num_stages = 0, 2
    stage.meter, stage.part = pipe.meter, SimpleNamespace(bytes_in=0)
    pipe._schedule = FakeSchedule(stage, clock)
    return pipe


def step(pipe, state) -> None:
    pipe.forward_backward(state, torch.zeros(8, 3), torch.zeros(8), loss_fn=None)


def measured(pipe) -> dict:
    pipe.on_fit_end(SimpleNamespace(world=world(world_size=1)))
    per_rank = pipe.summary()["measured"]["per_rank"]
    assert len(per_rank) == 1
    return {key: per_rank[0][key] for key in EXPECTED}


def test_on_a_cpu_the_stage_times_are_the_host_clocks_sums(clock):
    pipe = timed_pipeline(CPU, clock)
    phases = PhaseClock(CPU)
    phases.start_step()
    phases.switch("forward")  # as the session's forward_backward does
    step(pipe, SimpleNamespace(clock=phases, is_warmup=False))
    step_s, times = phases.end_step()
    assert step_s == EXPECTED["step_s"]
    assert times["forward"] == EXPECTED["forward_s"]
    assert times["backward"] == EXPECTED["backward_s"]
    assert times["bubble"] == EXPECTED["bubble_s"]
    assert measured(pipe) == EXPECTED


class Moves:
    """Stands in for the phase clock: keeps what is moved, to read it later."""

    def __init__(self) -> None:
        self.moved: list = []

    def reattribute(self, source, target, seconds) -> None:
        self.moved.append((source, target, seconds))

    def read(self) -> dict[str, float]:
        assert all(callable(seconds) for _, _, seconds in self.moved)  # not read in the step
        read = {target: seconds() for _, target, seconds in self.moved}
        self.moved.clear()
        return read


def test_on_a_gpu_the_step_never_waits_for_the_device(clock, monkeypatch):
    waits = []

    class FakeEvent:  # a CUDA event on the fake clock's timeline
        def __init__(self, enable_timing=False) -> None:
            self.enable_timing = enable_timing
            self.time = None

        def record(self, stream=None) -> None:
            self.time = clock.now

        def query(self) -> bool:
            waits.append("query")
            return True

        def synchronize(self) -> None:
            waits.append("synchronize")

        def elapsed_time(self, end) -> float:  # as strict as CUDAEvent::elapsed_time
            assert self.enable_timing and end.enable_timing, "made without enable_timing"
            assert self.time is not None and end.time is not None, "not recorded"
            return (end.time - self.time) * 1000.0

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: waits.append("device"))
    pipe = timed_pipeline(CUDA, clock)
    moves = Moves()
    step(pipe, SimpleNamespace(clock=moves, is_warmup=True))  # not in the summary
    assert waits == []
    created = pipe.meter.marks.created
    assert created == 2 + 2 * 12  # the step's ends, and each chunk's
    assert moves.read() == {"backward": EXPECTED["backward_s"], "bubble": EXPECTED["bubble_s"]}
    read = len(waits)
    for _ in range(2):
        step(pipe, SimpleNamespace(clock=moves, is_warmup=False))
    assert waits[read:] == []
    assert pipe.meter.marks.created == created * 2  # the read step's events came back
    assert measured(pipe) == EXPECTED
    assert pipe.meter.marks.created == created * 2
