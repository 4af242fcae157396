"""Real SIGKILLs at random moments, including mid-persist (the stress script, 20 kills)."""

import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from checkpoint_crash import kill_loop  # noqa: E402


@pytest.mark.slow
def test_twenty_kills_lose_no_checkpoint_and_at_most_two_intervals(tmp_path):
    stats = kill_loop(tmp_path / "run", kills=20, every=2, seed=1)
    assert stats["kills"] == 20
    assert stats["unloadable"] == []  # every kill left a loadable, intact checkpoint
    assert stats["max_lost_steps"] <= 2 * stats["every"]
    assert stats["mid_persist"] >= 1  # the kills did land while checkpoints were being written
    assert stats["bitwise_equal_to_uninterrupted"]
