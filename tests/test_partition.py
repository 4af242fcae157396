"""The ``partition`` policy: how it divides a rank's cores, that threads and worker
processes really run where it says (read back from /proc), and that it changes
where work runs, never what is computed."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import run_cli
from overlapkit import Session, get_optimization
from overlapkit.data import ResumableLoader, ShardedSampler, SyntheticImages
from overlapkit.runtime import CombinationError, Demand, SchedulerConfig
from overlapkit.runtime import cores as linux
from overlapkit.runtime.partition import PartitionPolicy
from overlapkit.runtime.split import Profile, size_split
from overlapkit.tuning import TuneConfig
from overlapkit.tuning.space import SpaceError, apply_params, build_space

Prefetch = get_optimization("prefetch")
Checkpoint = get_optimization("checkpoint")
TWO_CORES = pytest.mark.skipif(len(linux.available()) < 2, reason="needs 2 cores")

demands = st.lists(
    st.builds(Demand, st.sampled_from(["loader", "feeder", "persist"]), st.integers(0, 8)),
    max_size=3,
    unique_by=lambda d: d.consumer,
)


@settings(max_examples=300, deadline=None)
@given(
    cores=st.lists(st.integers(0, 127), min_size=1, max_size=64, unique=True),
    demands=demands,
    needed=st.one_of(st.none(), st.tuples(st.floats(0, 200), st.floats(0, 200))),
    own=st.one_of(st.none(), st.integers(0, 200)),
    threads=st.one_of(st.none(), st.integers(1, 200)),
    spill=st.booleans(),
)
def test_the_split_never_exceeds_the_ranks_cores(cores, demands, needed, own, threads, spill):
    profile = None if needed is None else Profile(3, 1.0, *needed)
    split = size_split(
        cores, demands, threads=threads, background_cores=own, spill=spill, profile=profile
    )
    assert split.compute, "compute always keeps a core"
    assert not set(split.compute) & set(split.background)
    assert set(split.compute) | set(split.background) == set(cores)
    assert len(split.background) <= sum(d.threads for d in demands)
    assert split.compute_threads >= 1
    for consumer, places in split.consumers.items():
        assert places and set(places) <= set(cores), consumer
        if split.background:  # it has cores of its own: it uses them
            assert set(split.background) <= set(places)
            assert bool(set(places) & set(split.compute)) == spill


def test_the_profile_gives_the_background_the_cores_it_kept_busy():
    loader = [Demand("loader", 4), Demand("persist", 1)]
    cores = list(range(8))
    assert size_split(cores, loader).background == ()  # declared: compute keeps all
    assert size_split(cores, loader).compute_threads == 8
    # 30 % of the CPU time: 2.4 of 8 cores, 2 after rounding; however long the steps took.
    for step_s in (0.05, 0.5):
        busy = size_split(cores, loader, profile=Profile(3, step_s, 0.120, 0.280))
        assert busy.background == (6, 7) and busy.compute_threads == 6
    light = size_split(cores, loader, profile=Profile(3, 0.050, 0.020, 0.380))  # 0.4 cores
    assert light.background == () and light.compute_threads == 8
    # Never more cores than it has threads, and compute keeps one.
    assert size_split(cores, [Demand("loader", 1)], profile=Profile(3, 0.1, 1, 0)).background == (
        7,
    )
    assert size_split([0, 1], loader, profile=Profile(3, 0.1, 1, 0.01)).compute == (0,)
    # A knob or world.threads decides instead of the profile.
    assert size_split(cores, loader, background_cores=3).compute == (0, 1, 2, 3, 4)
    assert size_split(cores, loader, threads=5).background == (5, 6, 7)


def test_ranks_of_one_machine_get_disjoint_cores():
    cores = list(range(16))
    shares = [linux.rank_share(cores, rank, 2) for rank in range(2)]
    assert shares == [list(range(8)), list(range(8, 16))]
    assert [linux.rank_share([0, 1], rank, 3) for rank in range(3)] == [[0], [1], [0]]
    assert linux.parse_list("0-2,5,7-8") == {0, 1, 2, 5, 7, 8}


def cpu_heavy_loader(samples=1024, batch=16, cost_ms=1.0):
    dataset = SyntheticImages((3, 8, 8), 4, samples, seed=0, cost_ms=cost_ms, cost_kind="cpu")
    return ResumableLoader(dataset, batch, ShardedSampler(samples, seed=0))


def run_steps(session, loader, steps, during=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(192, 64), nn.ReLU(), nn.Linear(64, 4))
    model, optimizer, loader = session.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.05), loader
    )
    losses = []
    for inputs, targets in session.steps(steps, loader):
        with session.forward():
            loss = nn.functional.cross_entropy(model(inputs), targets)
        session.backward(loss)
        session.optimizer_step()
        session.end_step(loss)
        losses.append(loss.item())
        if during is not None:
            during(session)
    return losses, session.finish()


@TWO_CORES
@pytest.mark.parametrize("spill", [False, True])
def test_threads_and_worker_processes_run_on_the_cores_assigned(spill, tmp_path):
    """Read back from /proc, while the run is going: the compute threads (this one
    and torch's pool) on the compute core, the loader's worker processes, the
    feeder and the persist thread on the background's."""
    before = linux.allowed(linux.this_thread())
    policy = PartitionPolicy(background_cores=1, spill=spill, profile_steps=2)
    optimizations = [
        Prefetch(1.0, backend="torch", workers=2),
        Checkpoint(every=2, dir=str(tmp_path / "ckpt")),
    ]
    session = Session(optimizations, device="cpu", policy=policy, progress=False)
    seen: dict[str, set[int]] = {}

    def look(session):
        if session.state.step < 5:  # the split after the profile, every thread started
            return
        placed = policy.placements()  # a thread is placed before it is listed
        background = {t for tids in placed.values() for t in tids}
        compute_seen = {t: linux.allowed(t) for t in linux.threads_of() if t not in background}
        joined_since = {t for tids in policy.placements().values() for t in tids} - background
        for tid, allowed in compute_seen.items():
            if tid not in joined_since:  # not a thread that joined while we looked
                seen.setdefault("compute", set()).update(allowed)
        for consumer, tids in placed.items():
            for tid in tids:
                seen.setdefault(consumer, set()).update(linux.allowed(tid))
        seen["threads"] = {torch.get_num_threads()}

    _, summary = run_steps(session, cpu_heavy_loader(), 12, look)
    compute, background = {0}, {1}  # the rank's 2 cores, 1 kept for the background
    placed = policy.placements()
    assert len(placed["loader"]) == 2 and placed["feeder"] and placed["persist"]
    assert seen["compute"] == compute and seen["threads"] == {1}
    for consumer in ("loader", "feeder", "persist"):
        assert seen[consumer] == (background | compute if spill else background), consumer
    detail = summary["scheduler"]["partition"][0]
    assert detail["compute"] == [0] and detail["background"] == [1]
    assert detail["basis"] == "set" and detail["threads_placed"]["loader"] == 2
    # The process gets its cores and thread count back for whatever runs next.
    assert linux.allowed(linux.this_thread()) == before
    assert torch.get_num_threads() == len(before)


@TWO_CORES
def test_the_profile_measures_the_loaders_cpu_per_sample():
    """A loader that burns 1 ms of CPU per sample, 16 samples a step: the profile
    measures about 1 ms per sample (the split it makes from that depends on how
    long the steps took on this machine, so it is not asserted)."""
    policy = PartitionPolicy(profile_steps=3)
    session = Session(
        [Prefetch(1.0, backend="torch", workers=2)], device="cpu", policy=policy, progress=False
    )
    run_steps(session, cpu_heavy_loader(), 8)
    (declared, profiled) = policy.history
    assert declared["basis"] == "declared" and declared["background"] == []
    assert profiled["basis"] == "profiled" and profiled["step"] == 4
    profile = profiled["profile"]
    per_sample = profile["loader_cpu_s_per_sample"]
    assert 0.0008 < per_sample < 0.004, per_sample
    assert profile["background_cpu_s"] >= 16 * 0.0008 and profile["compute_cpu_s"] > 0


@pytest.mark.slow
def test_a_partition_run_has_the_losses_of_a_free_run_bit_for_bit(tiny_scenario, tmp_path):
    """Two ranks with loader workers and checkpoints: the cores each thread runs on
    change, and the profile's split; the batches, their order and the losses do not."""
    path = tiny_scenario()
    losses = {}
    for policy in ("free", "partition"):
        out = tmp_path / policy
        run_cli(
            "run", path, "--out", out, "--quiet",
            "--set", "world.nprocs=2",
            "--set", "train.steps=8",
            "--set", "data.sample_cost_ms=0.5",
            "--set", "data.sample_cost=cpu",
            "--set", "optimizations.prefetch.workers=2",
            "--set", "optimizations.checkpoint.every=3",
            "--set", f"scheduler.policy={policy}",
        )  # fmt: skip
        records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
        losses[policy] = [(r["step"], r["rank"], r["loss"]) for r in records]
        summary = json.loads((out / "summary.json").read_text())
    assert len(losses["free"]) == 20 and losses["partition"] == losses["free"]
    ranks = summary["scheduler"]["partition"]
    assert [r["basis"] for r in ranks] == ["profiled", "profiled"]
    assert not set(ranks[0]["cores"]) & set(ranks[1]["cores"])  # 1 core each of the 2


def test_the_split_is_in_the_trace(tmp_path):
    session = Session(
        [Prefetch(1.0, backend="torch", workers=1)],
        device="cpu",
        policy=PartitionPolicy(profile_steps=2),
        progress=False,
        trace=True,
        run_dir=tmp_path,
    )
    run_steps(session, cpu_heavy_loader(cost_ms=0.1), 6)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    marks = [e for e in events if e["name"] == "partition"]
    assert [m["args"]["basis"] for m in marks] == ["declared", "profiled"]
    assert marks[1]["args"]["step"] == 3 and marks[1]["args"]["compute"]


def test_settings_are_checked_and_searchable():
    with pytest.raises(ValueError, match="partition policy has no setting 'nice'"):
        SchedulerConfig(policy="partition", partition={"nice": 3})
    with pytest.raises(ValueError, match="background_nice=25 is out of range"):
        SchedulerConfig(policy="partition", partition={"background_nice": 25})
    policy = SchedulerConfig(policy="partition", partition={"spill": False}).build()
    assert policy.settings["spill"] is False and policy.settings["background_cores"] is None
    tune = TuneConfig(search={"prefetch": None, "scheduler": {"background_nice": [0, 19]}})
    space = build_space({"prefetch": {}}, tune)
    assert space.grid()["scheduler.policy"] == ["free", "priority", "partition"]
    params = {"prefetch.intensity": 1.0, "scheduler.policy": "partition"}
    data = apply_params({}, space, {**params, "scheduler.background_nice": 19})
    assert data["scheduler"] == {"policy": "partition", "partition": {"background_nice": 19}}
    with pytest.raises(SpaceError, match="searched by tune.policy"):
        build_space(
            {"prefetch": {}}, TuneConfig(search={"prefetch": None, "scheduler": ["policy"]})
        )
    with pytest.raises(SpaceError, match="does not run on tensorflow"):
        build_space({"prefetch": {}}, tune, "tensorflow")


def test_partition_on_tensorflow_is_refused_with_the_reason(tiny_scenario):
    from overlapkit.runtime import Scheduler

    with pytest.raises(CombinationError, match="partition runs on torch only: TensorFlow"):
        Scheduler([], "partition").check(1, "cpu", "gloo", framework="tensorflow")
