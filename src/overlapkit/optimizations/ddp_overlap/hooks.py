"""Comm hooks for DDP, each wrapped to time every bucket's all-reduce.

The wrapper marks when a bucket was handed to the hook (launch) and when
its future completed, from the future's own callback: exposed communication
is then measured, not inferred by subtracting step times. The marks are read
when they are ready (a few steps later on a GPU), never by waiting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from ...runtime.timing import Mark, Marks


@dataclass
class BucketCall:
    index: int
    nbytes: int
    launched: Mark
    completed: Mark = None


class BucketTimer:
    """Holds the calls of the current step; ``hook`` is what DDP calls.

    On NCCL the hook's future completes when the all-reduce is queued, and its
    callback runs with streams that wait for the all-reduce: the marks are CUDA
    events recorded there (see `timing.Marks`), so they time the work itself."""

    def __init__(self, inner: Any, marks: Marks) -> None:
        self.calls: list[BucketCall] = []
        self.marks = marks

        def timed_hook(state, bucket):  # DDP requires the parameter to be named "bucket"
            buffer = bucket.buffer()
            call = BucketCall(bucket.index(), buffer.numel() * buffer.element_size(), marks.mark())
            self.calls.append(call)

            def completed(future):
                call.completed = marks.mark()
                return future.value()

            return inner(state, bucket).then(completed)

        timed_hook.__name__ = timed_hook.__qualname__ = f"timed_{inner.__name__}"
        self.hook = timed_hook


class SyncTiming:
    """One step's gradient sync, read once its marks are ready: the time exposed
    after the last bucket started (every gradient was computed by then; DDP starts
    buckets in order), the time communication was busy, and each call's latency."""

    def __init__(self, calls: list[BucketCall], marks: Marks) -> None:
        self.calls, self.marks = calls, marks
        self._values: tuple[float, float, list[tuple[int, float]]] | None = None

    def _last_done(self) -> Mark:
        # On one device stream the last launched finishes last; host callbacks
        # (gloo) may finish in any order.
        if self.marks.on_device:
            return self.calls[-1].completed
        return max(c.completed for c in self.calls)

    def ready(self) -> bool:
        return self._values is not None or self.marks.ready(self._last_done())

    def values(self) -> tuple[float, float, list[tuple[int, float]]]:
        """(exposed seconds, busy seconds, [(bytes, latency seconds)] per call)."""
        if self._values is None:
            seconds = self.marks.seconds
            done = self._last_done()
            exposed = max(0.0, seconds(self.calls[-1].launched, done))
            busy = seconds(self.calls[0].launched, done)
            calls = [(c.nbytes, seconds(c.launched, c.completed)) for c in self.calls]
            self.marks.release(*(m for c in self.calls for m in (c.launched, c.completed)))
            self._values = exposed, busy, calls
        return self._values

    def exposed(self) -> float:
        return self.values()[0]


def make_hook(name: str, settings: dict[str, Any], group: Any = None) -> tuple[Any, Any]:
    """(state, hook) for DDP's ``register_comm_hook``."""
    if name == "none":
        # DDP's own default, as a Python hook so that it can be timed.
        return group, default_hooks.allreduce_hook
    if name == "fp16":
        return group, default_hooks.fp16_compress_hook
    if name == "bf16":
        return group, default_hooks.bf16_compress_hook
    if name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=settings["powersgd_rank"],
            start_powerSGD_iter=settings["powersgd_start_iter"],
            random_seed=0,
        )
        return state, powerSGD_hook.powerSGD_hook
    raise ValueError(f"unknown comm hook {name!r}")


def wire_bytes_factor(name: str) -> float:
    """Bytes on the wire per gradient byte (compression halves fp32)."""
    return 0.5 if name in ("fp16", "bf16") else 1.0
