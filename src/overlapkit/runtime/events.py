"""The events of a training run, in the order they fire."""

from __future__ import annotations

from enum import Enum


class Event(str, Enum):
    """Where the scheduler calls the optimizations' hooks.

    The training loop, with each event where it fires (the built-in loop and
    the custom-loop `Session` fire exactly these)::

        # FIT_START          model, optimizer and loader are wrapped; resume done
        for step in range(start_step, total_steps):
            # STEP_START
            batch = next(loader)              # phase: data_wait
            # AFTER_DATA
            # BEFORE_FORWARD
            loss = loss_fn(model(batch))      # phase: forward
            # AFTER_FORWARD
            # BEFORE_BACKWARD
            loss.backward()                   # phase: backward (+ comm_exposed)
            # AFTER_BACKWARD
            # BEFORE_OPTIMIZER_STEP           the saved state changes only after this
            optimizer.step(); zero_grad()     # phase: optimizer
            # AFTER_OPTIMIZER_STEP
            # STEP_END                        metrics for the step are closed here
            if step % eval_every == 0:
                # EVAL_START
                evaluate(model)
                # EVAL_END
        # FIT_END            background work is drained; summary is written

    Events named ``AFTER_*`` or ``*_END`` are exit events: their hooks run in
    the reverse of the declared order (first in, last out), so an optimization
    that wraps another's work on entry also unwraps it last.
    """

    FIT_START = "fit_start"
    STEP_START = "step_start"
    AFTER_DATA = "after_data"
    BEFORE_FORWARD = "before_forward"
    AFTER_FORWARD = "after_forward"
    BEFORE_BACKWARD = "before_backward"
    AFTER_BACKWARD = "after_backward"
    BEFORE_OPTIMIZER_STEP = "before_optimizer_step"
    AFTER_OPTIMIZER_STEP = "after_optimizer_step"
    STEP_END = "step_end"
    EVAL_START = "eval_start"
    EVAL_END = "eval_end"
    FIT_END = "fit_end"

    @property
    def is_exit(self) -> bool:
        return self.value.startswith("after_") or self.value.endswith("_end")

    @property
    def hook_name(self) -> str:
        """The method an optimization defines to run at this event, e.g. ``on_step_end``."""
        return "on_" + self.value
