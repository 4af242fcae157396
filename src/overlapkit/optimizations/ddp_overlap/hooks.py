"""Comm hooks for DDP, each wrapped to time every bucket's all-reduce.

The wrapper records when a bucket was handed to the hook (launch) and when
its future completed, from the future's own callback: exposed communication
is then measured, not inferred by subtracting step times.
"""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter
from typing import Any

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook


@dataclass
class BucketCall:
    index: int
    nbytes: int
    launched: float
    completed: float = 0.0


class BucketTimer:
    """Holds the calls of the current step; ``hook`` is what DDP calls."""

    def __init__(self, inner: Any) -> None:
        self.calls: list[BucketCall] = []

        def timed_hook(state, bucket):  # DDP requires the parameter to be named "bucket"
            buffer = bucket.buffer()
            call = BucketCall(
                bucket.index(), buffer.numel() * buffer.element_size(), perf_counter()
            )
            self.calls.append(call)

            def completed(future):
                call.completed = perf_counter()
                return future.value()

            return inner(state, bucket).then(completed)

        timed_hook.__name__ = timed_hook.__qualname__ = f"timed_{inner.__name__}"
        self.hook = timed_hook


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
