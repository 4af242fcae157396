"""Knob declarations, the intensity mapping and the registry."""

import pytest

from overlapkit import get_optimization, registered_optimizations
from overlapkit.runtime import Knob, KnobError, Optimization


def test_numeric_knob_interpolates_linearly_and_geometrically():
    linear = Knob(name="x", type=float, default=0.0, low=0, high=10, intensity=(2.0, 10.0))
    assert linear.at_intensity(0.0) == 2.0
    assert linear.at_intensity(0.5) == pytest.approx(6.0)
    assert linear.at_intensity(1.0) == 10.0
    log = Knob(
        name="mb", type=float, default=25.0, low=1, high=256, log=True, intensity=(256.0, 1.0)
    )
    assert log.at_intensity(0.5) == pytest.approx(16.0)  # the geometric midpoint
    assert log.at_intensity(0.25) == pytest.approx(64.0)


def test_int_knob_rounds_and_multi_anchor_ladders():
    ladder = Knob(name="depth", type=int, default=1, low=1, high=8, intensity=(1, 2, 8))
    assert [ladder.at_intensity(i) for i in (0.0, 0.25, 0.5, 0.75, 1.0)] == [1, 2, 2, 5, 8]
    choice = Knob(
        name="mode", type=str, default="a", choices=("a", "b", "c"), intensity=("a", "b", "c")
    )
    assert [choice.at_intensity(i) for i in (0.0, 0.3, 0.5, 0.8, 1.0)] == ["a", "b", "b", "c", "c"]
    fixed = Knob(name="flag", type=bool, default=True)
    assert fixed.at_intensity(0.7) is True


@pytest.mark.parametrize(
    "knob, value, fragment",
    [
        (Knob(name="n", type=int, default=1, low=1, high=4), 5, "out of range: allowed 1 to 4"),
        (Knob(name="n", type=int, default=1, low=1, high=4), 2.5, "whole number"),
        (Knob(name="n", type=int, default=1), "two", "must be a number"),
        (Knob(name="n", type=int, default=1), True, "must be a number"),
        (Knob(name="b", type=bool, default=True), 1, "true or false"),
        (
            Knob(name="c", type=str, default="a", choices=("a", "b")),
            "z",
            "choose one of ['a', 'b']",
        ),
    ],
)
def test_knob_rejects_bad_values(knob, value, fragment):
    with pytest.raises(KnobError, match=None) as error:
        knob.coerce(value)
    assert fragment in str(error.value)
    assert error.value.knob == knob.name


def test_explicit_knobs_override_the_intensity_mapping():
    probe = get_optimization("toy_probe")
    assert probe.resolve(0.0, {}) == {"depth": 1, "mode": "a", "ratio": 0.5}
    assert probe.resolve(1.0, {}) == {"depth": 16, "mode": "c", "ratio": 0.5}
    assert probe.resolve(1.0, {"depth": 3})["depth"] == 3
    instance = probe(0.5, ratio=0.25)
    assert instance.settings == {"depth": 4, "mode": "b", "ratio": 0.25}
    assert instance.summary() == {"intensity": 0.5, "depth": 4, "mode": "b", "ratio": 0.25}


def test_unknown_knob_and_bad_intensity_are_named():
    probe = get_optimization("toy_probe")
    with pytest.raises(
        KnobError, match=r"no knob 'dept' \(did you mean 'depth'\?\); allowed: intensity, depth"
    ):
        probe.resolve(1.0, {"dept": 2})
    with pytest.raises(KnobError, match="intensity=1.5 is out of range"):
        probe.resolve(1.5, {})


def test_registry_finds_plugins_and_suggests_names():
    assert {"toy_probe", "toy_fail"} <= set(registered_optimizations())
    with pytest.raises(KnobError, match="did you mean 'toy_probe'"):
        get_optimization("toy_prob")


def test_describe_lists_knobs_for_the_tuner():
    described = get_optimization("toy_probe").describe()
    depth = described["knobs"][0]
    assert depth == {
        "name": "depth",
        "type": "int",
        "default": 1,
        "range": [1, 16],
        "log": True,
        "intensity": [1, 16],
    }
    assert described["resources"] == ["host_cpu"]


def test_min_world_size_is_checked():
    class NeedsTwo(Optimization):
        name = "needs_two"
        min_world_size = 2

    with pytest.raises(ValueError, match="needs at least 2 ranks, the run has 1"):
        NeedsTwo().check(1, "cpu", "gloo")
    NeedsTwo().check(2, "cpu", "gloo")


def test_a_knob_whose_default_breaks_its_own_range_is_refused_at_registration():
    from overlapkit import register_optimization

    class Broken(Optimization):
        name = "broken_default"
        knobs = (Knob(name="every", type=int, default=500, low=0, high=100),)

    with pytest.raises(TypeError, match="the default of knob every: every=500 is out of range"):
        register_optimization(Broken)
