"""A `PipelineStage` that times its own compute, so that a step's remaining time
is what the stage spent waiting: the bubble (and any transfer not hidden)."""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter
from typing import Any

from torch.distributed.pipelining import PipelineStage

from .layers import StageModule, tensor_bytes


@dataclass
class StepMeter:
    """Seconds of one rank's step, summed over its stages and micro-batches."""

    forward_s: float = 0.0
    backward_s: float = 0.0  # input gradients (the whole backward, unless split)
    weight_s: float = 0.0  # weight gradients, when a zero-bubble schedule splits them off
    last_backward_s: float = 0.0  # the final micro-batch's backward: all DDP can overlap with
    sent_bytes: int = 0  # activations sent on, and the gradients of those received, sent back

    def reset(self) -> None:
        self.forward_s = self.backward_s = self.weight_s = self.last_backward_s = 0.0
        self.sent_bytes = 0

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.weight_s


class TimedStage(PipelineStage):
    """``part`` is the stage's `StageModule` (``submodule`` may be it wrapped in DDP)."""

    def __init__(self, *args: Any, meter: StepMeter, part: StageModule, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.meter = meter
        self.part = part

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        received = self.part.bytes_in
        start = perf_counter()
        output = super().forward_one_chunk(*args, **kwargs)
        self.meter.forward_s += perf_counter() - start
        if not self.is_last:
            self.meter.sent_bytes += tensor_bytes(output)
        if not self.is_first:  # the gradient of what came in goes back
            self.meter.sent_bytes += self.part.bytes_in - received
        return output

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed_backward("backward_s", super().backward_one_chunk, args, kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed_backward("weight_s", super().backward_weight_one_chunk, args, kwargs)

    def _timed_backward(self, field: str, run: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        start = perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            seconds = perf_counter() - start
            setattr(self.meter, field, getattr(self.meter, field) + seconds)
            if kwargs.get("last_backward"):
                self.meter.last_backward_s += seconds
