"""prefetch: the same batches with every setting and every back end (torch,
tf.data, DALI), synchronous loading at intensity 0, measured data-wait
reduction, exact resume position, missing extras."""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest
import torch
from torch import nn

from overlapkit import Session, get_optimization
from overlapkit.data import ResumableLoader, ShardedSampler, SyntheticImages, SyntheticTokens
from overlapkit.optimizations.prefetch import (
    BACKENDS,
    Feeder,
    MissingDependencyError,
    PrefetchError,
)
from overlapkit.runtime import CombinationError, Resource

Prefetch = get_optimization("prefetch")
SHAPE = (3, 8, 8)


class LoadRecordingImages(SyntheticImages):
    """Remembers when each sample was loaded (in this process: no worker processes)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.loads: list[tuple[float, float]] = []

    def __getitem__(self, index):
        start = time.perf_counter()
        sample = super().__getitem__(index)
        self.loads.append((start, time.perf_counter()))
        return sample


def make_loader(dataset=None, batch=8):
    dataset = dataset or SyntheticImages(SHAPE, num_classes=4, num_samples=64, seed=3)
    return ResumableLoader(dataset, batch, ShardedSampler(len(dataset), seed=3))


def wrapped(intensity=1.0, loader=None, **knobs):
    """A prefetching loader, as the scheduler wraps it (through a Session)."""
    session = Session([Prefetch(intensity, **knobs)], device="cpu", progress=False)
    session.prepare(nn.Linear(1, 1), None, make_loader() if loader is None else loader)
    return session.state.loader, session.scheduler.optimizations[0]  # iterated without steps


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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "knobs",
    [
        {"intensity": 0.0},
        {"intensity": 0.5},
        {"intensity": 1.0},
        {"workers": 0, "depth": 3, "device_depth": 0},
        {"workers": 2, "depth": 1, "device_depth": 2, "persistent_workers": False},
    ],
)
def test_every_setting_of_every_back_end_delivers_the_batches_of_plain_loading(backend, knobs):
    plain = batches(make_loader(), 20)  # 8 batches an epoch: crosses two epoch ends
    knobs = dict(knobs)
    if backend != "torch":
        knobs.pop("persistent_workers", None)  # the torch back end's only (refused elsewhere)
    prefetching, _ = wrapped(knobs.pop("intensity", 1.0), backend=backend, **knobs)
    assert_same_batches(plain, batches(prefetching, 20))


@pytest.mark.parametrize("backend", ["tfdata", "dali"])
def test_token_batches_are_identical_across_back_ends(backend):
    tokens = SyntheticTokens(seq_len=16, vocab_size=256, num_samples=48, seed=5)
    plain = batches(make_loader(tokens), 9)
    prefetching, _ = wrapped(1.0, make_loader(tokens), backend=backend, workers=2)
    got = batches(prefetching, 9)
    assert got[0][0].dtype == torch.int64 and got[0][0].shape == (8, 16)
    assert_same_batches(plain, got)


def overlaps(loads, computes):
    return sum(1 for a, b in loads for c, d in computes if a < d and c < b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_intensity_zero_loads_only_while_training_waits_and_a_feeder_loads_during_compute(
    backend,
):
    """Intensity 0 is synchronous: no sample is loaded while the training thread
    computes. With the feeder (workers 0, so loading stays in this process), they are."""

    def loads_during_compute(intensity, **knobs):
        dataset = LoadRecordingImages(SHAPE, num_classes=4, num_samples=64, seed=3, cost_ms=1)
        prefetching, opt = wrapped(intensity, make_loader(dataset), backend=backend, **knobs)
        iterator, computes = iter(prefetching), []
        for _ in range(6):
            next(iterator)
            start = time.perf_counter()
            threading.Event().wait(0.02)  # compute
            computes.append((start, time.perf_counter()))
        iterator.close()
        return overlaps(dataset.loads, computes), opt

    during, opt = loads_during_compute(0.0)
    assert opt.settings["workers"] == 0 and opt.settings["depth"] == 0
    assert during == 0
    during, _ = loads_during_compute(1.0, workers=0)
    assert during >= 8  # at least a batch loaded while computing


def test_intensity_zero_runs_the_dataset_on_the_training_thread():
    class ThreadRecordingImages(SyntheticImages):
        threads: set[int] = set()

        def __getitem__(self, index):
            self.threads.add(threading.get_ident())
            return super().__getitem__(index)

    dataset = ThreadRecordingImages(SHAPE, num_classes=4, num_samples=64, seed=3)
    prefetching, _ = wrapped(0.0, make_loader(dataset))
    assert prefetching.feeder_depth == 0
    batches(prefetching, 4)
    assert dataset.threads == {threading.get_ident()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_mid_epoch_continues_with_the_next_batch(backend):
    uninterrupted = batches(make_loader(), 14)
    first, _ = wrapped(1.0, backend=backend)
    iterator = iter(first)
    seen = [next(iterator) for _ in range(5)]  # the back end has loaded more than 5
    saved = first.state_dict()
    assert saved == {"epoch": 0, "position": 5}
    iterator.close()
    resumed, _ = wrapped(1.0, backend=backend)
    resumed.load_state_dict(saved)
    assert_same_batches(uninterrupted, seen + batches(resumed, 9))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("intensity", [0.0, 1.0])
def test_a_short_last_batch_is_delivered_by_every_back_end(backend, intensity):
    """drop_last=False, 22 samples in batches of 4: DALI dropped the short batch of 2."""

    def loader():
        dataset = SyntheticImages(SHAPE, num_classes=4, num_samples=22, seed=3)
        return ResumableLoader(dataset, 4, ShardedSampler(22, seed=3, drop_last=False))

    plain = batches(loader(), 14)  # 6 batches an epoch, the last of 2 samples
    assert [len(y) for _, y in plain[:7]] == [4, 4, 4, 4, 4, 2, 4]
    prefetching, _ = wrapped(intensity, loader(), backend=backend)
    assert_same_batches(plain, batches(prefetching, 14))
    resumed, _ = wrapped(intensity, loader(), backend=backend)
    resumed.load_state_dict({"epoch": 0, "position": 3})
    assert_same_batches(plain[3:], batches(resumed, 11))


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefetching_takes_the_loading_time_off_the_step(backend):
    """A source that sleeps 4 ms per sample (32 ms a batch) beside 30 ms of compute:
    loading on the training thread waits for every batch, two workers hide it."""
    data = SyntheticImages(SHAPE, num_classes=4, num_samples=256, seed=0, cost_ms=4.0)

    def data_wait(intensity, **knobs):
        session = Session(
            [Prefetch(intensity, backend=backend, **knobs)],
            device="cpu",
            warmup_steps=3,
            progress=False,
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
    # Hidden: ~0 when the machine is idle; half is a margin for a loaded one.
    assert data_wait(1.0, workers=2, depth=4) < 0.5 * synchronous


class LoggedSlowImages(SyntheticImages):
    """Each sample takes 20 ms and appends its start time to a file (workers are
    other processes or threads)."""

    def __init__(self, log, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log = str(log)

    def __getitem__(self, index):
        with open(self.log, "a") as f:
            f.write(f"{time.time()}\n")
        time.sleep(0.02)
        return super().__getitem__(index)


@pytest.mark.parametrize("policy", ["priority", "free"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_workers_wait_while_the_step_waits_on_communication_under_priority(
    backend, policy, tmp_path
):
    log = tmp_path / "loads"
    dataset = LoggedSlowImages(log, SHAPE, num_classes=4, num_samples=512, seed=3)
    knobs = {"backend": backend, "workers": 2, "depth": 16, "device_depth": 0}
    session = Session([Prefetch(1.0, **knobs)], device="cpu", progress=False, policy=policy)
    session.prepare(nn.Linear(1, 1), None, make_loader(dataset))
    loader = session.state.loader
    iterator = iter(loader)
    next(iterator)  # the workers are running and have 16 batches (5 s of loading) to do

    def loaded() -> list[float]:
        return [float(line) for line in log.read_text().split()]

    deadline = time.monotonic() + 60
    while len(loaded()) < 12 and time.monotonic() < deadline:  # beyond the first batch
        time.sleep(0.05)
    with session.scheduler.policy.critical(Resource.NETWORK, Resource.HOST_CPU):
        entered = time.time()
        time.sleep(0.8)
        left = time.time()
    deadline = time.monotonic() + 60
    while not [t for t in loaded() if t > left] and time.monotonic() < deadline:
        time.sleep(0.05)
    starts = loaded()
    loader.close()
    # A sample that had passed the gate as the step began may start a little later.
    during = [t for t in starts if entered + 0.2 < t < left]
    after = [t for t in starts if t > left]
    assert after  # loading went on afterwards
    if policy == "priority":
        assert not during, f"{len(during)} samples started while the step waited"
        assert session.scheduler.policy.stats()["worker_samples_yielded"] >= 1
    else:
        assert len(during) >= 5  # the control: 2 workers x 20 ms samples for 0.6 s, ~60


def test_a_loader_that_cannot_resume_is_refused_with_the_fix():
    with pytest.raises(PrefetchError, match="map-style torch DataLoader or .*ResumableLoader"):
        wrapped(1.0, [torch.zeros(2)] * 5)


def test_a_scripts_own_dataloader_is_prefetched_in_its_own_order_by_the_torch_back_end():
    def loader():
        torch.manual_seed(0)
        return torch.utils.data.DataLoader(list(range(40)), batch_size=4, shuffle=True)

    plain = [b.tolist() for b in loader()]
    prefetching, _ = wrapped(1.0, loader(), backend="torch", workers=2)
    torch.manual_seed(0)  # the epoch's shuffle is drawn when the epoch starts, as plainly
    assert [b.tolist() for b in prefetching] == plain
    with pytest.raises(PrefetchError, match="backend tfdata reads .*ResumableLoader"):
        wrapped(1.0, loader(), backend="tfdata")


def test_a_dataloader_over_an_iterable_dataset_is_refused_by_name():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(8))

    loader = torch.utils.data.DataLoader(Stream(), batch_size=4)
    with pytest.raises(PrefetchError, match=r"got a DataLoader over an IterableDataset \(Stream\)"):
        wrapped(1.0, loader)


def double_labels(samples):
    images, labels = torch.utils.data.default_collate(samples)
    return {"images": images, "labels": labels * 2}


@pytest.mark.parametrize("backend", ["tfdata", "dali"])
def test_a_collate_function_the_back_end_cannot_run_is_refused(backend):
    """tf.data and DALI stack samples themselves: a ResumableLoader's collate_fn was
    silently left out (tuples, not the function's dicts)."""
    dataset = SyntheticImages(SHAPE, num_classes=4, num_samples=64, seed=3)
    loader = ResumableLoader(dataset, 8, ShardedSampler(64, seed=3), collate_fn=double_labels)
    assert set(next(iter(loader))) == {"images", "labels"}
    with pytest.raises(PrefetchError, match=f"backend {backend} .* no collate_fn.*backend: torch"):
        wrapped(1.0, loader, backend=backend)
    prefetching, _ = wrapped(1.0, loader, backend="torch")
    assert set(next(iter(prefetching))) == {"images", "labels"}


def test_a_failing_source_raises_on_the_training_thread():
    def source():
        yield 1
        raise OSError("disk gone")

    feeder = iter(Feeder(source(), torch.device("cpu"), 2))
    assert next(feeder) == 1
    with pytest.raises(OSError, match="disk gone"):
        next(feeder)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_with_prefetch_resumes_bitwise_from_a_checkpoint(backend, tiny_scenario, tmp_path):
    """Through `overlapkit run`: workers load ahead, a checkpoint at step 4 of an
    8-batch epoch, a stop at step 5, a resume: the losses are those of one run.
    The resumed run prints its summary as JSON: stdout holds nothing else."""
    import json

    from conftest import run_cli

    common = [
        "--quiet",
        "--set",
        "train.warmup_steps=0",
        "--set",
        "data.num_samples=64",
        "--set",
        f"optimizations.prefetch={{intensity: 1, workers: 2, backend: {backend}}}",
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
            "--json",
        )
        assert part.returncode == 0, part.stderr[-2000:]
    summary = json.loads(part.stdout)  # nothing but the summary on stdout
    assert summary == json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["optimizations"]["checkpoint"]["resumed_from_step"] == 4
    assert summary["optimizations"]["prefetch"]["workers"] == 2
    assert summary["optimizations"]["prefetch"]["backend"] == backend

    def losses(name):
        lines = (tmp_path / name / "steps.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines)}

    resumed = losses("b")
    assert set(resumed) == set(range(10))  # the first run's steps 0-3 kept before its own
    assert all(losses("a")[step] == loss for step, loss in resumed.items())


@pytest.mark.parametrize(
    ("backend", "module", "extra"),
    [("tfdata", "tensorflow", "tensorflow"), ("dali", "nvidia.dali", "dali")],
)
def test_a_missing_optional_dependency_names_the_extra_to_install(
    backend, module, extra, monkeypatch
):
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    install = f"pip install 'overlapkit[{extra}]'"
    with pytest.raises(CombinationError) as refused:
        Session([Prefetch(1.0, backend=backend)], device="cpu", progress=False)
    assert install in str(refused.value)
    from overlapkit.optimizations.prefetch.optimization import _build_backend

    opt = Prefetch(1.0, backend=backend)
    with pytest.raises(MissingDependencyError) as missing:
        _build_backend(opt.settings, make_loader(), torch.device("cpu"), pin=False)
    assert install in str(missing.value)


def test_overlapkit_check_refuses_a_back_end_whose_extra_is_missing(tiny_scenario):
    import subprocess

    blocked = (
        "import sys; sys.modules['tensorflow'] = None; "
        "from overlapkit.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            blocked,
            "check",
            str(tiny_scenario()),
            "--set",
            "optimizations.prefetch={backend: tfdata}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "pip install 'overlapkit[tensorflow]'" in result.stderr + result.stdout


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # no worker is started
def test_the_intensity_mapping_overlapkit_list_shows_is_what_prefetch_uses(capsys):
    from overlapkit.cli import main

    assert main(["list", "--json"]) == 0
    (listed,) = [o for o in json.loads(capsys.readouterr().out)["optimizations"]
                 if o["name"] == "prefetch"]  # fmt: skip
    mapping = listed["intensity_mapping"]
    # The README's numbers: 0 synchronous, 0.5 -> 2 workers, 4 ahead, 1 handed over ahead,
    # 1 -> 4 workers, 8 ahead, 2 handed over ahead.
    readme = {"0": (0, 0, 0), "0.5": (2, 4, 1), "1.0": (4, 8, 2)}
    for intensity, (workers, depth, device_depth) in readme.items():
        assert (mapping[intensity]["workers"], mapping[intensity]["depth"]) == (workers, depth)
        assert mapping[intensity]["device_depth"] == device_depth
    for intensity, shown in mapping.items():
        loader, opt = wrapped(float(intensity), backend="torch")
        assert opt.settings == shown, intensity
        # What the loading really does: the DataLoader's workers keep `depth` batches in
        # flight, and the feeder hands `device_depth` over ahead.
        data_loader = loader.backend.inner.loader
        assert data_loader.num_workers == shown["workers"], intensity
        if shown["workers"]:
            assert data_loader.prefetch_factor * shown["workers"] == shown["depth"], intensity
            assert loader.feeder_depth == shown["device_depth"], intensity
        else:  # loading on the training thread, when the step asks
            assert loader.feeder_depth == 0 and shown["depth"] == 0, intensity
        loader.close()


def test_persistent_workers_with_a_back_end_that_keeps_its_own_is_refused(tiny_scenario):
    """Under framework: torch with backend tfdata it was shown as set and ignored (the
    summary said persistent_workers=True)."""
    from conftest import cli_here

    result = cli_here(
        "check", tiny_scenario(), "--set",
        "optimizations.prefetch={backend: tfdata, persistent_workers: false}",
    )  # fmt: skip
    assert result.returncode == 2, result.stdout
    assert "persistent_workers means something only when backend is torch" in result.stderr
    # A tune over back ends leaves it out of the trials of the others (not refused).
    from overlapkit.optimizations.prefetch import Prefetch
    from overlapkit.tuning.space import _without_idle_knobs

    entry = {"intensity": 1.0, "backend": "tfdata", "persistent_workers": False}
    assert _without_idle_knobs(Prefetch, entry) == {"intensity": 1.0, "backend": "tfdata"}
