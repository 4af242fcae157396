"""Ordering, wrapping, dispatch and the trace."""

from types import SimpleNamespace

import pytest

from overlapkit.runtime import (
    CombinationError,
    Event,
    Optimization,
    PhaseClock,
    Scheduler,
    WrapStage,
)
from overlapkit.runtime.arbitration import ArbitrationPolicy


def make(name, *, after=(), before=(), conflicts=(), provides=(), stage=WrapStage.OTHER, log=None):
    log = log if log is not None else []

    def hook(event):
        return lambda self, state: log.append((name, event))

    attrs = {
        "name": name,
        "after": tuple(after),
        "before": tuple(before),
        "conflicts": tuple(conflicts),
        "provides": frozenset(provides),
        "wrap_stage": stage,
        "on_step_start": hook("step_start"),
        "on_step_end": hook("step_end"),
        "wrap_model": lambda self, model, state: [*model, name],
    }
    return type(name, (Optimization,), attrs)()


def fake_state():
    return SimpleNamespace(step=0, clock=PhaseClock(), model=[], optimizer=None, loader=None)


def test_order_follows_after_and_before_and_keeps_listing_order_otherwise():
    a, b, c, d = make("a"), make("b", after=["c"]), make("c"), make("d", before=["a"])
    ordered = [o.name for o in Scheduler([a, b, c, d]).optimizations]
    # c and d are free to go first (c is listed first); b follows c, a follows d.
    assert ordered == ["c", "b", "d", "a"]
    # Declarations about absent optimizations are ignored.
    assert [o.name for o in Scheduler([make("x", after=["nope"]), make("y")]).optimizations] == [
        "x",
        "y",
    ]


def test_exit_events_run_in_reverse_and_the_trace_records_them():
    log = []
    scheduler = Scheduler([make("first", log=log), make("second", after=["first"], log=log)])
    state = fake_state()
    scheduler.fire(Event.STEP_START, state)
    scheduler.fire(Event.STEP_END, state)
    assert log == [
        ("first", "step_start"),
        ("second", "step_start"),
        ("second", "step_end"),
        ("first", "step_end"),
    ]
    assert scheduler.trace.order_at(Event.STEP_START) == ["first", "second"]
    assert scheduler.trace.order_at(Event.STEP_END) == ["second", "first"]
    hooks = scheduler.trace.summary()
    assert hooks["first"]["step_start"]["calls"] == 1
    assert hooks["second"]["step_end"]["total_s"] >= 0.0
    chrome = scheduler.trace.chrome_events()
    assert [e["name"] for e in chrome] == [
        "first.step_start",
        "second.step_start",
        "second.step_end",
        "first.step_end",
    ]
    assert all(e["ph"] == "X" and e["dur"] >= 0 for e in chrome)


def test_cycles_conflicts_duplicates_and_roles_are_rejected():
    with pytest.raises(CombinationError, match=r"cycle among \['a', 'b'\]"):
        Scheduler([make("a", after=["b"]), make("b", after=["a"])])
    with pytest.raises(CombinationError, match="a cannot run together with b"):
        Scheduler([make("a", conflicts=["b"]), make("b")])
    with pytest.raises(CombinationError, match="listed twice"):
        Scheduler([make("a"), make("a")])
    with pytest.raises(CombinationError, match="a and b both provide grad_sync"):
        Scheduler([make("a", provides=["grad_sync"]), make("b", provides=["grad_sync"])])


def test_model_wrappers_apply_in_the_fixed_stage_order():
    other = make("other")
    data_parallel = make("dp", stage=WrapStage.DATA_PARALLEL)
    split = make("split", stage=WrapStage.SPLIT)
    scheduler = Scheduler([other, data_parallel, split])
    state = fake_state()
    scheduler.wrap(state)
    assert state.model == ["split", "dp", "other"]


def test_hook_time_is_counted_as_other_not_in_the_surrounding_phase(fake_clock):
    slow = type(
        "slow",
        (Optimization,),
        {
            "name": "slow",
            "on_after_data": lambda self, state: fake_clock.sleep(0.05),
        },
    )()
    scheduler = Scheduler([slow])
    state = fake_state()
    state.clock.start_step()
    state.clock.switch("forward")
    scheduler.fire(Event.AFTER_DATA, state)
    assert state.clock.current == "forward"
    _, phases = state.clock.end_step()
    assert phases["other"] == pytest.approx(0.05, abs=1e-9)
    assert phases["forward"] == 0.0
    assert scheduler.trace.summary()["slow"]["after_data"]["total_s"] == pytest.approx(0.05)


def test_policy_by_name():
    assert Scheduler([], "priority").policy.name == "priority"
    assert isinstance(Scheduler([]).policy, ArbitrationPolicy)
