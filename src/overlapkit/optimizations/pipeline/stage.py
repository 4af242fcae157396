"""A `PipelineStage` that times its own compute, so that a step's remaining time
is what the stage spent waiting: the bubble (and any transfer not hidden).

The times are marks (see `runtime.timing`): on a GPU, CUDA events on the current
stream, where the stage's kernels run; their seconds are read once the step's
work is done, a few steps later, so that measuring never makes the host wait."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage

from ...runtime.timing import Mark, Marks
from .layers import StageModule, tensor_bytes

FIELDS = ("forward_s", "backward_s", "weight_s")


class StepMeter:
    """Marks around one rank's compute in a step, over its stages and micro-batches.

    ``backward_s`` is the input gradients (the whole backward, unless split);
    ``weight_s`` the weight gradients, when a zero-bubble schedule splits them off.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.marks = Marks(device)
        self.reset()

    def reset(self) -> None:
        # (field, begin, end, in the final micro-batch's backward: all DDP can overlap with)
        self.spans: list[tuple[str, Mark, Mark, bool]] = []
        self.sent_bytes = 0  # activations sent on, and the gradients of those received, sent back

    def close(self, begin: Mark, end: Mark) -> StepTimes:
        """The step from ``begin`` to ``end``, with the spans marked since `reset`."""
        times = StepTimes(self.marks, begin, end, self.spans, self.sent_bytes)
        self.reset()
        return times


class StepTimes:
    """One step's seconds, summed over its stages and micro-batches: read once its
    marks are done (`result`), then the marks go back to the pool."""

    def __init__(
        self,
        marks: Marks,
        begin: Mark,
        end: Mark,
        spans: list[tuple[str, Mark, Mark, bool]],
        sent_bytes: int,
    ) -> None:
        self._marks, self._begin, self._end, self._spans = marks, begin, end, spans
        self._sent_bytes = sent_bytes
        self._result: dict[str, float] | None = None

    def result(self) -> dict[str, float]:
        if self._result is None:
            # Added up in the order they were marked, as the host's clock used to be.
            totals = dict.fromkeys((*FIELDS, "last_backward_s"), 0.0)
            for field, begin, end, last in self._spans:
                seconds = Marks.seconds(begin, end)
                totals[field] += seconds
                if last:
                    totals["last_backward_s"] += seconds
            step = Marks.seconds(self._begin, self._end)
            compute = totals["forward_s"] + totals["backward_s"] + totals["weight_s"]
            self._result = {
                "step_s": step,
                "forward_s": totals["forward_s"],
                "backward_s": totals["backward_s"] + totals["weight_s"],
                "last_backward_s": totals["last_backward_s"],
                "bubble_s": max(0.0, step - compute),  # waiting: the bubble, exposed transfers
                "sent_bytes": self._sent_bytes,
            }
            spans = [mark for _, begin, end, _ in self._spans for mark in (begin, end)]
            self._marks.release(self._begin, self._end, *spans)
            self._spans = []
        return self._result


class TimedStage(PipelineStage):
    """``part`` is the stage's `StageModule` (``submodule`` may be it wrapped in DDP)."""

    def __init__(self, *args: Any, meter: StepMeter, part: StageModule, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.meter = meter
        self.part = part

    def _get_init_p2p_neighbors_ops(self) -> list[Any]:
        """torch 2.9-2.12 warm the links up by sending to every neighbouring stage,
        also one on this same rank (a V schedule's two middle stages); gloo refuses a
        send to itself ("Pair is not connected"). Stages on one rank hand over without
        sending, so their warm-up is left out. (torch 2.13 no longer calls this.)"""
        ops = super()._get_init_p2p_neighbors_ops()
        return [op for op in ops if getattr(op, "group_peer", None) != self.group_rank]

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        """torch sets a stage up (at the first step, and again at each switch between
        training and ``eval``) by running its forward once: on the first micro-batch on
        the first stage, on uninitialised tensors on the others, in the module's mode.
        In training mode that pass updated batch-norm statistics: once more than the
        micro-batches on the first stage, and with garbage on the others (NaN running
        statistics, an evaluation at chance). The stage's buffers are put back, through
        ``.data``: torch's backward set-up differentiates that same pass next (for the
        gradients' shapes only), and autograd would refuse a buffer it saved changed in
        place."""
        saved = [(buffer, buffer.detach().clone()) for buffer in self.submod.buffers()]
        try:
            return super()._prepare_forward_infra(*args, **kwargs)
        finally:
            for buffer, value in saved:
                buffer.data.copy_(value)

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        received = self.part.bytes_in
        begin = self.meter.marks.mark()
        output = super().forward_one_chunk(*args, **kwargs)
        self.meter.spans.append(("forward_s", begin, self.meter.marks.mark(), False))
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
        begin = self.meter.marks.mark()
        try:
            return run(*args, **kwargs)
        finally:
            end = self.meter.marks.mark()
            self.meter.spans.append((field, begin, end, bool(kwargs.get("last_backward"))))
