"""Phase attribution, POP metrics and the cross-rank summary."""

import threading
import time

import pytest
import torch

from overlapkit.runtime import PHASES, PhaseClock, PriorityPolicy, Resource
from overlapkit.runtime.arbitration import ArbitrationPolicy
from overlapkit.runtime.metrics import pop_metrics, step_record, summarize


def test_phases_partition_the_step_exactly(fake_clock):
    clock = PhaseClock()
    clock.start_step()
    with clock.phase("data_wait"):
        fake_clock.sleep(0.02)
    clock.switch("forward")
    fake_clock.sleep(0.03)
    clock.switch("other")
    with clock.phase("ckpt_stall"):
        fake_clock.sleep(0.01)
    step_time, phases = clock.end_step()
    assert set(phases) == set(PHASES)
    assert sum(phases.values()) == pytest.approx(step_time, rel=1e-9)
    assert step_time == pytest.approx(0.06, abs=1e-9)
    expected = {**dict.fromkeys(PHASES, 0.0), "data_wait": 0.02, "forward": 0.03}
    assert phases == pytest.approx({**expected, "ckpt_stall": 0.01}, abs=1e-9)


def test_reattribute_moves_time_and_never_below_zero():
    clock = PhaseClock()
    clock.start_step()
    clock.switch("backward")
    time.sleep(0.03)
    clock.reattribute("backward", "comm_exposed", 0.01)
    clock.reattribute("forward", "comm_exposed", 5.0)  # forward had nothing to give
    step_time, phases = clock.end_step()
    assert phases["comm_exposed"] == pytest.approx(0.01)
    assert phases["forward"] == 0.0
    assert sum(phases.values()) == pytest.approx(step_time)


def test_pop_metrics_on_known_inputs():
    pop = pop_metrics([8.0, 6.0], runtime_s=10.0)
    assert pop["load_balance"] == pytest.approx(7.0 / 8.0)
    assert pop["communication_efficiency"] == pytest.approx(0.8)
    assert pop["parallel_efficiency"] == pytest.approx(0.7)
    assert pop_metrics([], 1.0)["parallel_efficiency"] == 0.0


def _record(step, rank, time_s, forward, warmup=False):
    phases = dict.fromkeys(PHASES, 0.0)
    phases["forward"] = forward
    phases["other"] = time_s - forward
    return step_record(
        step=step,
        rank=rank,
        loss=1.0 + step,
        samples=10,
        step_time_s=time_s,
        phases_s=phases,
        warmup=warmup,
    )


def test_summary_skips_warmup_and_takes_the_slowest_rank_per_step():
    records = [_record(0, r, 9.0, 1.0, warmup=True) for r in (0, 1)]
    records += [
        _record(1, 0, 1.0, 0.8),
        _record(1, 1, 2.0, 0.4),
        _record(2, 0, 1.0, 0.8),
        _record(2, 1, 1.0, 0.4),
    ]
    summary = summarize(records, world_size=2)
    assert summary["steps"] == 2
    assert summary["step_time_s"]["mean"] == pytest.approx(1.5)  # max(1, 2) and max(1, 1)
    assert summary["runtime_s"] == pytest.approx(3.0)  # rank 1: 2 + 1
    assert summary["samples_per_s"] == pytest.approx(40 / 3.0)
    assert summary["phases_s"]["forward"] == pytest.approx(0.6)
    assert summary["pop"]["load_balance"] == pytest.approx(1.2 / 1.6)
    assert summary["pop"]["communication_efficiency"] == pytest.approx(1.6 / 3.0)
    assert summary["final_loss"] == pytest.approx(3.0)
    assert [r["rank"] for r in summary["per_rank"]] == [0, 1]


def test_priority_policy_holds_background_work_while_the_critical_path_runs():
    policy = PriorityPolicy()
    started = []

    def background():
        with policy.background(Resource.DISK):
            started.append(time.perf_counter())

    with policy.critical(Resource.DISK):
        worker = threading.Thread(target=background)
        worker.start()
        time.sleep(0.1)
        assert not started  # still waiting
        released = time.perf_counter()
    worker.join(2)
    assert started and started[0] >= released
    assert policy.stats()["background_chunks_yielded"] == 1
    # Another resource is not held back.
    with policy.critical(Resource.NETWORK), policy.background(Resource.DISK):
        pass


def test_consecutive_steps_leave_no_time_uncounted_unless_paused(fake_clock):
    clock = PhaseClock()
    clock.start_step()
    first, _ = clock.end_step()
    fake_clock.sleep(0.03)  # between steps: e.g. logging
    clock.start_step()
    second, phases = clock.end_step()
    assert second == pytest.approx(0.03, abs=1e-9)
    assert phases["other"] == pytest.approx(0.03, abs=1e-9)
    clock.pause()
    fake_clock.sleep(0.03)  # e.g. evaluation
    clock.start_step()
    third, _ = clock.end_step()
    assert third == 0.0


def test_a_persist_write_pauses_between_chunks_while_the_step_waits_on_communication(tmp_path):
    from overlapkit.optimizations.checkpoint.store import write_state

    policy = PriorityPolicy()
    chunks = []

    def gate():
        chunks.append(time.perf_counter())
        policy.pause(Resource.DISK, Resource.HOST_CPU)

    tree = {"w": torch.arange(3 * 1024 * 1024, dtype=torch.float32)}  # 12 MiB: 3+ chunks
    done = threading.Event()
    worker = threading.Thread(
        target=lambda: (write_state(tmp_path / "a.ckpt", tree, gate), done.set())
    )
    with policy.critical(Resource.NETWORK, Resource.HOST_CPU):
        worker.start()
        deadline = time.monotonic() + 30
        while not chunks and time.monotonic() < deadline:  # however slowly it starts
            time.sleep(0.01)
        time.sleep(0.2)
        assert not done.is_set() and len(chunks) == 1  # held before its first chunk
        released = time.perf_counter()
    worker.join(30)
    assert done.is_set() and len(chunks) >= 3
    assert all(t >= released for t in chunks[1:])
    assert policy.stats()["background_chunks_yielded"] == 1
    assert policy.stats()["background_yield_s"] >= 0.1  # held 0.2 s, counted (wide margin)
    # The free policy never holds anything back.
    free = ArbitrationPolicy()
    with free.critical(Resource.HOST_CPU):
        free.pause(Resource.HOST_CPU)
