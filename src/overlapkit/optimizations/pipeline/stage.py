"""A `PipelineStage` that times its own compute, so that a step's remaining time
is what the stage spent waiting: the bubble (and any transfer not hidden)."""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter
from typing import Any

from torch.distributed.pipelining import PipelineStage


@dataclass
class StepMeter:
    """Seconds of one rank's step, summed over its stages and micro-batches."""

    forward_s: float = 0.0
    backward_s: float = 0.0  # input gradients (the whole backward, unless split)
    weight_s: float = 0.0  # weight gradients, when a zero-bubble schedule splits them off
    last_backward_s: float = 0.0  # the final micro-batch's backward: all DDP can overlap with

    def reset(self) -> None:
        self.forward_s = self.backward_s = self.weight_s = self.last_backward_s = 0.0

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.weight_s


class TimedStage(PipelineStage):
    def __init__(self, *args: Any, meter: StepMeter, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.meter = meter

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        start = perf_counter()
        try:
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            self.meter.forward_s += perf_counter() - start

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        start = perf_counter()
        try:
            return super().backward_one_chunk(*args, **kwargs)
        finally:
            seconds = perf_counter() - start
            self.meter.backward_s += seconds
            if kwargs.get("last_backward"):
                self.meter.last_backward_s += seconds

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        start = perf_counter()
        try:
            return super().backward_weight_one_chunk(*args, **kwargs)
        finally:
            seconds = perf_counter() - start
            self.meter.weight_s += seconds
            if kwargs.get("last_backward"):
                self.meter.last_backward_s += seconds
