"""prefetch: the same batches with every setting, loading off the training thread,
measured data-wait reduction, exact resume position."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from overlapkit import Session, get_optimization
from overlapkit.data import ResumableLoader, ShardedSampler, SyntheticImages
from overlapkit.optimizations.prefetch import Feeder, PrefetchError

Prefetch = get_optimization("prefetch")
SHAPE = (3, 8, 8)


class ThreadRecordingImages(SyntheticImages):
    """Remembers which thread loaded each sample (workers are other processes)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.threads: set[int] = set()

    def __getitem__(self, index):
        self.threads.add(threading.get_ident())
        return super().__getitem__(index)


def make_loader(dataset=None, batch=8):
    dataset = dataset or SyntheticImages(SHAPE, num_classes=4, num_samples=64, seed=3)
    return ResumableLoader(dataset, batch, ShardedSampler(len(dataset), seed=3))


def wrapped(intensity=1.0, loader=None, **knobs):
    """A prefetching loader, as the scheduler wraps it (through a Session)."""
    session = Session([Prefetch(intensity, **knobs)], device="cpu", progress=False)
    _, _, prefetching = session.prepare(nn.Linear(1, 1), None, loader or make_loader())
    return prefetching, session.scheduler.optimizations[0]


def batches(loader, count):
    out, iterator = [], iter(loader)
    while len(out) < count:
        try:
            out.append(next(iterator))
        except StopIteration:
            iterator = iter(loader)
    return out


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for (x1, y1), (x2, y2) in zip(a, b, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


@pytest.mark.parametrize(
    "knobs",
    [
        {"intensity": 0.5},
        {"intensity": 1.0},
        {"workers": 0, "depth": 3, "device_depth": 0},
        {"workers": 2, "depth": 1, "device_depth": 2, "persistent_workers": False},
    ],
)
def test_every_setting_delivers_the_same_batches_as_plain_loading(knobs):
    plain = batches(make_loader(), 20)  # 8 batches an epoch: crosses two epoch ends
    knobs = dict(knobs)
    prefetching, _ = wrapped(knobs.pop("intensity", 1.0), **knobs)
    assert_same_batches(plain, batches(prefetching, 20))


def test_intensity_zero_loads_on_the_training_thread_and_a_feeder_does_not():
    dataset = ThreadRecordingImages(SHAPE, num_classes=4, num_samples=64, seed=3)
    prefetching, opt = wrapped(0.0, make_loader(dataset))
    assert opt.settings["workers"] == 0 and prefetching.feeder_depth == 0
    batches(prefetching, 4)
    assert dataset.threads == {threading.get_ident()}
    dataset.threads.clear()
    prefetching, _ = wrapped(1.0, make_loader(dataset), workers=0)
    batches(prefetching, 4)
    assert dataset.threads and threading.get_ident() not in dataset.threads


def test_resume_mid_epoch_continues_with_the_next_batch():
    uninterrupted = batches(make_loader(), 14)
    first, _ = wrapped(1.0)
    iterator = iter(first)
    seen = [next(iterator) for _ in range(5)]  # the back end has loaded more than 5
    saved = first.state_dict()
    assert saved == {"epoch": 0, "position": 5}
    iterator.close()
    resumed, _ = wrapped(1.0)
    resumed.load_state_dict(saved)
    assert_same_batches(uninterrupted, seen + batches(resumed, 9))


def test_prefetching_takes_the_loading_time_off_the_step():
    """A source that sleeps 4 ms per sample (32 ms a batch) beside 30 ms of compute:
    loading on the training thread waits for every batch, two workers hide it."""
    data = SyntheticImages(SHAPE, num_classes=4, num_samples=256, seed=0, cost_ms=4.0)

    def data_wait(intensity, **knobs):
        session = Session(
            [Prefetch(intensity, **knobs)], device="cpu", warmup_steps=3, progress=False
        )
        model = nn.Sequential(nn.Flatten(), nn.Linear(192, 4))
        model, optimizer, _ = session.prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.1), make_loader(data)
        )
        for inputs, targets in session.steps(15):
            with session.forward():
                loss = nn.functional.cross_entropy(model(inputs), targets)
                threading.Event().wait(0.03)  # compute that releases the cores
            session.backward(loss)
            session.optimizer_step()
        return session.finish()["phases_s"]["data_wait"]

    synchronous = data_wait(0.0)
    assert synchronous > 0.025  # 8 samples x 4 ms, on the training thread
    assert data_wait(1.0, workers=2, depth=4) < 0.3 * synchronous


def test_a_loader_that_cannot_resume_is_refused_with_the_fix():
    plain = torch.utils.data.DataLoader(list(range(10)), batch_size=2)
    with pytest.raises(PrefetchError, match="ResumableLoader"):
        wrapped(1.0, plain)


def test_a_failing_source_raises_on_the_training_thread():
    def source():
        yield 1
        raise OSError("disk gone")

    feeder = iter(Feeder(source(), torch.device("cpu"), 2))
    assert next(feeder) == 1
    with pytest.raises(OSError, match="disk gone"):
        next(feeder)


@pytest.mark.slow
def test_a_run_with_prefetch_resumes_bitwise_from_a_checkpoint(tiny_scenario, tmp_path):
    """Through `overlapkit run`: workers load ahead, a checkpoint at step 4 of an
    8-batch epoch, a stop at step 5, a resume: the losses are those of one run."""
    import json

    from conftest import run_cli

    common = [
        "--quiet",
        "--set",
        "train.warmup_steps=0",
        "--set",
        "data.num_samples=64",
        "--set",
        "optimizations.prefetch={intensity: 1, workers: 2}",
        "--set",
        "optimizations.checkpoint={every: 4, final: false}",
    ]
    straight = run_cli(
        "run", tiny_scenario(), "--out", tmp_path / "a", *common, "--set", "train.steps=10"
    )
    assert straight.returncode == 0, straight.stderr[-2000:]
    for steps in (5, 10):
        part = run_cli(
            "run",
            tiny_scenario(),
            "--out",
            tmp_path / "b",
            *common,
            "--set",
            f"train.steps={steps}",
        )
        assert part.returncode == 0, part.stderr[-2000:]
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["optimizations"]["checkpoint"]["resumed_from_step"] == 4
    assert summary["optimizations"]["prefetch"]["workers"] == 2

    def losses(name):
        lines = (tmp_path / name / "steps.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines)}

    resumed = losses("b")
    assert set(resumed) == set(range(4, 10))
    assert all(losses("a")[step] == loss for step, loss in resumed.items())


def test_a_back_end_not_built_yet_is_refused_before_any_rank_starts(tiny_scenario, tmp_path):
    from conftest import run_cli

    result = run_cli(
        "check", tiny_scenario(), "--set", "optimizations.prefetch={backend: dali}", timeout=60
    )
    assert result.returncode != 0
    assert "prefetch backend 'dali' is not built yet" in result.stderr + result.stdout
