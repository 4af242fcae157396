"""Steps whose times and loss are still on their way from the device.

A closed step waits here until its phase times (`StepTiming`) and its loss
(`AsyncScalar`) can be read without making the host wait for the device; then
it becomes a `steps.jsonl` record. On a CPU that is at once. On a GPU it is
usually one or two steps later; a step never waits longer than ``max_lag``
steps (reading it then waits on work that finished long ago).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from time import monotonic, sleep
from typing import Any

from .metrics import StepTiming, step_record
from .timing import AsyncScalar


@dataclass
class PendingStep:
    step: int
    rank: int
    samples: int
    warmup: bool
    timing: StepTiming
    loss: AsyncScalar | float | None  # None: this rank computes no loss

    def ready(self) -> bool:
        loss_ready = not isinstance(self.loss, AsyncScalar) or self.loss.ready()
        return loss_ready and self.timing.ready()

    def record(self) -> dict[str, Any]:
        step_time, phases = self.timing.result()
        loss = self.loss.value() if isinstance(self.loss, AsyncScalar) else self.loss
        return step_record(
            step=self.step,
            rank=self.rank,
            loss=loss,
            samples=self.samples,
            step_time_s=step_time,
            phases_s=phases,
            warmup=self.warmup,
        )


class StepLog:
    """Closed steps in order; `ready` yields the records that can be read now."""

    def __init__(self, max_lag: int = 8) -> None:
        self.max_lag = max_lag
        self._pending: deque[PendingStep] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, step: PendingStep) -> None:
        self._pending.append(step)

    def ready(self) -> Iterator[dict[str, Any]]:
        """The records of the oldest steps that are ready (in order), and of any step
        more than ``max_lag`` behind."""
        while self._pending and (len(self._pending) > self.max_lag or self._pending[0].ready()):
            yield self._pending.popleft().record()

    def drain(self) -> Iterator[dict[str, Any]]:
        """Every remaining record, waiting for the device if need be (at the end)."""
        while self._pending:
            yield self._pending.popleft().record()

    def settle(self, seconds: float) -> Iterator[dict[str, Any]]:
        """The records of the steps the device finishes within ``seconds``, in order (at
        a stop: a step whose collective waits for a peer that is gone never finishes)."""
        deadline = monotonic() + seconds
        while self._pending:
            if self._pending[0].ready():
                record = self._pending[0].record()  # (kept if the read is interrupted)
                self._pending.popleft()
                yield record
            elif monotonic() < deadline:
                sleep(0.001)
            else:
                return
