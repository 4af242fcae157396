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

import pytest

from overlapkit.optimizations.checkpoint.store import Manifest, verify

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
