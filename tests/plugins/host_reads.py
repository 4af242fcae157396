"""Reads of a tensor's value by the host during a run's steps: a CPU stand-in for the
GPU's sync check (`torch.cuda.set_sync_debug_mode("error")`, tests/test_on_gpu.py).
Importable by ranks, so multi-rank runs are watched in each rank."""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from overlapkit import Session
from overlapkit.runtime.timing import AsyncScalar

HOST_READS = {
    torch.ops.aten._local_scalar_dense.default,  # .item(), float(t), int(t), bool(t)
    torch.ops.aten.equal.default,
    torch.ops.aten.nonzero.default,  # a shape that depends on the values
    torch.ops.aten.masked_select.default,
    torch.ops.aten._unique2.default,
}
BOOL_INDEXED = {  # x[mask], x[mask] = y: a nonzero inside the kernel, below the mode
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
}
TORCH = f"{os.sep}torch{os.sep}"
# Code whose reads are of values on the host on a GPU too: data loading, and
# torch.optim's step counts (host tensors unless the optimizer is fused or capturable).
HOST_SIDE = (
    f"{os.sep}overlapkit{os.sep}data{os.sep}",
    f"{TORCH}utils{os.sep}data{os.sep}",
    f"{TORCH}optim{os.sep}",
)
# torch's pipeline schedule sets its stages up again as it switches between training
# and evaluation (a vote with ``.item()``, shapes sent as objects): torch's own, once an
# evaluation, not a step's.
TORCH_ONCE = {"_warmup_p2p", "_prepare_forward_infra"}
FROM_STEP = 2  # the first steps set up (a pipeline's shape inference): read once, not a step


class HostReads(TorchDispatchMode):
    """Each read of a tensor's value by the host (``.item()``, ``float()``, ``bool()``,
    ``.tolist()``, ``.numpy()``, ``.cpu()``, ``torch.equal``, a boolean mask, a
    value-dependent shape) in this thread and its backward passes, from the end of
    step `FROM_STEP` - 1 to `Session.finish`: on a GPU each one makes the host wait for
    the device. On a CPU every tensor is on the host, so a read is left out when the
    code that made it, the innermost frame outside torch's own, reads what is on the
    host on a GPU too (`HOST_SIDE`), and so is a loss read through `AsyncScalar` (on a
    GPU its pinned copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_steps: list[str] = []
        self.in_evaluation: list[str] = []
        self.stepping = False
        self.reading_a_copy = 0
        self.thread = threading.get_ident()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        bool_index = func in BOOL_INDEXED and any(
            i is not None and i.dtype == torch.bool for i in args[1]
        )
        if func in HOST_READS or bool_index:
            self.read(str(func))
        return func(*args, **(kwargs or {}))

    def read(self, what: str) -> None:
        if not self.stepping or self.reading_a_copy or threading.get_ident() != self.thread:
            return
        frames = traceback.extract_stack()[:-2]
        if any(f.name in TORCH_ONCE for f in frames):
            return
        for frame in reversed(frames):  # the innermost code that is not torch's own
            if any(part in frame.filename for part in HOST_SIDE):
                return
            if TORCH not in frame.filename:
                break
        ours = [f for f in frames if f"{os.sep}overlapkit{os.sep}" in f.filename]
        where = f"{what}: " + " <- ".join(
            f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in ours[::-1]
        )
        evaluating = any(f.name == "_evaluate" for f in ours)
        (self.in_evaluation if evaluating else self.in_steps).append(where)

    @contextlib.contextmanager
    def watching(self) -> Iterator[HostReads]:
        """The mode, with the reads that reach no op on a CPU (a CPU tensor's
        ``.tolist()``, ``.numpy()`` and ``.cpu()`` read its memory) told too."""
        patched: dict[tuple[Any, str], Any] = {}

        def patch(owner: Any, name: str, make: Any) -> None:
            patched[owner, name] = getattr(owner, name)
            setattr(owner, name, make(patched[owner, name]))

        def told(name: str):
            def make(method):
                def wrapper(tensor, *args, **kwargs):
                    self.read(f"Tensor.{name}")
                    return method(tensor, *args, **kwargs)

                return wrapper

            return make

        def copied(value):  # on a GPU, a pinned host copy whose event has completed
            def wrapper(scalar):
                self.reading_a_copy += 1
                try:
                    return value(scalar)
                finally:
                    self.reading_a_copy -= 1

            return wrapper

        def end_step(method):
            def wrapper(session, *args, **kwargs):
                method(session, *args, **kwargs)
                self.stepping = self.stepping or session.state.step >= FROM_STEP

            return wrapper

        def finish(method):
            def wrapper(session, *args, **kwargs):
                self.stepping = False
                return method(session, *args, **kwargs)

            return wrapper

        for name in ("tolist", "numpy", "cpu"):
            patch(torch.Tensor, name, told(name))
        patch(AsyncScalar, "value", copied)
        patch(Session, "end_step", end_step)
        patch(Session, "finish", finish)
        try:
            with self:
                yield self
        finally:
            for (owner, name), original in patched.items():
                setattr(owner, name, original)


def reads_of_a_run(text: str, overrides: list[str], folder: str) -> dict[str, list[str]]:
    """The scenario ``text`` run in this rank (under the launcher, or alone), watched."""
    from overlapkit.run import rank_main
    from overlapkit.scenarios import load_scenario

    path = Path(folder) / f"scenario-{os.environ.get('RANK', 0)}.yaml"
    path.write_text(text)
    scenario = load_scenario(path, overrides)
    with HostReads().watching() as reads:
        rank_main(scenario, Path(folder) / "run", False, False)
    return {"in_steps": reads.in_steps, "in_evaluation": reads.in_evaluation}
