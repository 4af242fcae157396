"""A process that ends while overlapkit's background threads are still at work (a
stopped run, a script that leaves its loop) exits normally. Without the stop at exit,
a thread inside a torch operation is ended by Python's finalization with
`pthread_exit`, and the process aborts ("terminate called without an active
exception", SIGABRT): the snapshot-copy and feeder scripts did so every time. A
persist under way is abandoned at its next chunk and leaves earlier checkpoints whole."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from overlapkit import Session, get_optimization
from overlapkit.optimizations.checkpoint.store import Manifest, rank_file, step_dir, verify
from overlapkit.runtime import background
from overlapkit.runtime.arbitration import ArbitrationPolicy
from overlapkit.runtime.background import start_thread

SNAPSHOT_COPY = """
    import torch
    from overlapkit.optimizations.checkpoint.snapshot import Snapshotter
    state = {f"w{i}": torch.ones(1 << 20) for i in range(64)}  # 256 MB to copy
    Snapshotter(torch.device("cpu")).take(1, state, None)  # copied on a thread
"""

FEEDER = """
    import torch
    from overlapkit.optimizations.prefetch.feeder import Feeder
    def products():
        a = torch.randn(1500, 1500)
        while True:
            yield a @ a
    ahead = iter(Feeder(products(), torch.device("cpu"), depth=1))
    first = next(ahead)  # the thread is computing the next one
"""

# A script that leaves its loop without `finish()`, a checkpoint's persist under way.
SESSION = """
    import sys, torch
    from overlapkit import Session, get_optimization
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    checkpoint = get_optimization("checkpoint")(every=2)
    session = Session([checkpoint], device="cpu", run_dir=sys.argv[1], progress=False)
    model, optimizer, _ = session.prepare(model, optimizer)
    for x in session.steps(5, [torch.randn(8, 2048)] * 5):
        with session.forward():
            loss = model(x).square().mean()
        session.backward(loss)
        session.optimizer_step()
"""


@pytest.mark.parametrize(
    "script", [SNAPSHOT_COPY, FEEDER, SESSION], ids=["snapshot-copy", "feeder", "session"]
)
def test_a_process_ending_with_background_work_under_way_exits_normally(script, tmp_path):
    run = tmp_path / "run"
    code = textwrap.dedent(script) + "print('leaving', flush=True)\n"
    ended = subprocess.run(
        [sys.executable, "-c", code, str(run)], capture_output=True, text=True, timeout=120
    )
    assert ended.returncode == 0, ended.stderr[-2000:]
    assert ended.stdout == "leaving\n"
    assert "terminate called" not in ended.stderr
    if script is SESSION:
        # Loses nothing: every checkpoint the manifest lists is whole (a persist cut
        # short at exit is not listed).
        listed = Manifest(run / "checkpoints").read()
        assert listed and [e["step"] for e in listed][0] == 2
        for entry in listed:
            assert verify(run / "checkpoints", entry, list(entry["files"])) is None


class HoldPersists(ArbitrationPolicy):
    """Holds a persist between two of its chunks once ``hold`` is set, until released."""

    def __init__(self) -> None:
        self.hold, self.holding, self.release = (threading.Event() for _ in range(3))

    def pause(self, *resources) -> None:
        if self.hold.is_set():
            self.holding.set()
            self.release.wait()


def test_stop_all_abandons_a_persist_under_way_and_keeps_the_earlier_checkpoint(tmp_path):
    policy = HoldPersists()
    checkpoint = get_optimization("checkpoint")(every=2, final=False)
    session = Session([checkpoint], policy=policy, device="cpu", run_dir=tmp_path)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])  # 8 MB
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer, _ = session.prepare(model, optimizer)
    manifest = Manifest(tmp_path / "checkpoints")
    for x in session.steps(5, [torch.randn(4, 512)] * 5):
        if session.state.step == 3:  # step 2's checkpoint persists unhindered
            while not manifest.read():
                time.sleep(0.01)
            policy.hold.set()  # step 4's is held after its first chunk
        with session.forward():
            loss = model(x).square().mean()
        session.backward(loss)
        session.optimizer_step()
    assert policy.holding.wait(60)
    # Released only after the persister was told to stop (stop callbacks run in order).
    start_thread(policy.release.wait, name="release", stop=policy.release.set)
    assert background.stop_all() == []
    assert [entry["step"] for entry in manifest.read()] == [2]
    assert not (step_dir(tmp_path / "checkpoints", 4) / rank_file(0)).exists()
