"""Splitting the compiled step into phases, from a sampled window of TensorFlow's
profiler.

Inside one compiled step forward, backward, communication and the optimizer
cannot be timed apart per step. For a few steps (the window) TensorFlow's
profiler records every op the step runs; from its trace:

- ``comm_exposed``: the time inside the step call when no compute op ran, when
  the step ran collectives (it waited on them); without any, that time is
  ``other`` (the runtime's own overhead);
- ``forward``, ``backward``, ``optimizer``: the rest, in proportion to the op
  time of each (ops under ``gradient_tape/`` are backward, under the
  optimizer's name optimizer, the others forward).

Rank 0's fractions split every rank's compiled time (the ranks run the same
step); the summary's
``phases_source`` names the window. Without a window (too few steps) nothing
is split: those phases are not measured (None), the compiled time stays in
``compiled_step_s``, and ``phases_source`` says why.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

FUSED = "compiled_step"
STEP_FUNCTION = "train_step"
WINDOW_STEPS = 3


@dataclass
class PhaseSplit:
    rank: int
    steps: tuple[int, int]
    fractions: dict[str, float]


@dataclass
class ProfileWindow:
    start: int
    stop: int
    rank: int = 0
    _dir: str = ""

    def begin(self, tf: Any) -> None:
        self._dir = tempfile.mkdtemp(prefix="overlapkit-tfprofile-")
        options = tf.profiler.experimental.ProfilerOptions(
            host_tracer_level=2, python_tracer_level=0, device_tracer_level=1
        )
        tf.profiler.experimental.start(self._dir, options=options)

    def end(self, tf: Any) -> PhaseSplit | None:
        tf.profiler.experimental.stop()
        try:
            files = glob.glob(os.path.join(self._dir, "**", "*.xplane.pb"), recursive=True)
            if not files:
                return None
            fractions = fractions_from_trace(files[0])
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)
        return (
            None if fractions is None else PhaseSplit(self.rank, (self.start, self.stop), fractions)
        )


def profile_window(
    warmup_steps: int, total_steps: int, start: int, rank: int
) -> ProfileWindow | None:
    """The steps to profile: the last warm-up steps after the first (which compiles),
    else the first measured ones; in a resumed run that started past them, the steps
    after its own first (which compiles again): they are the only steps it measures.
    None when too few steps are left, and on every rank but 0 (TensorFlow's profiler
    in two processes of one cluster at once crashed a worker: "double free or
    corruption")."""
    if rank != 0:
        return None
    if warmup_steps >= 2:
        first, stop = max(1, warmup_steps - WINDOW_STEPS), warmup_steps
    else:
        first = max(1, warmup_steps)
        stop = min(total_steps, first + WINDOW_STEPS)
    if first <= start:
        first = start + 1
        stop = min(total_steps, first + WINDOW_STEPS)
    if stop <= first:
        return None
    return ProfileWindow(first, stop, rank)


def why_unprofiled(total_steps: int, start: int) -> str:
    """Why `profile_window` gave no window (on rank 0)."""
    if start:
        return (
            f"resumed at step {start} with {total_steps - start} step(s) left, too few to "
            "profile (the first after a resume compiles; a profile needs one more)"
        )
    return (
        f"too few steps to profile (train.warmup_steps + train.steps = {total_steps}; the "
        "first step compiles, a profile needs one more)"
    )


def _union(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for begin, finish in sorted(intervals):
        if end is None or begin > end:
            total += finish - begin
            end = finish
        elif finish > end:
            total += finish - end
            end = finish
    return total


def _category(name: str, optimizers: tuple[str, ...]) -> str | None:
    """An op of the step's graph is traced as ``scope/op:Type``; the runtime's own
    events (``ExecutorState::Process``) and tf.data's ops (unscoped) are none."""
    scope, _, op_type = name.rpartition(":")
    if not scope or " " in name or "::" in name or scope.endswith(":"):
        return None
    if "Collective" in op_type:
        return "comm"
    if "/" not in scope:
        return None  # tf.data's functions and the like, on their own threads
    if scope.startswith("gradient_tape/"):
        return "backward"
    if scope.split("/", 1)[0] in optimizers:
        return "optimizer"
    return "forward"


# The name scopes of the optimizers build_optimizer makes (Keras names AdamW "adam_w").
OPTIMIZER_SCOPES = ("sgd", "adam", "adam_w", "adamw", "loss_scale_optimizer")


def fractions_from_trace(path: str) -> dict[str, float] | None:
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    steps: list[tuple[int, int]] = []
    ops: dict[str, list[tuple[int, int]]] = {
        "forward": [],
        "backward": [],
        "optimizer": [],
        "comm": [],
    }
    for plane in space.planes:
        for line in plane.lines:
            base = line.timestamp_ns * 1000
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                span = (base + event.offset_ps, base + event.offset_ps + event.duration_ps)
                if name == STEP_FUNCTION:
                    steps.append(span)
                    continue
                category = _category(name, OPTIMIZER_SCOPES)
                if category is not None:
                    ops[category].append(span)
    if not steps:
        return None
    stepped = sum(end - begin for begin, end in steps)

    def inside(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
        clipped = []
        for begin, end in spans:
            for s_begin, s_end in steps:
                low, high = max(begin, s_begin), min(end, s_end)
                if low < high:
                    clipped.append((low, high))
        return clipped

    compute = inside(ops["forward"] + ops["backward"] + ops["optimizer"])
    busy = _union(compute)
    op_time = {k: sum(e - b for b, e in inside(v)) for k, v in ops.items() if k != "comm"}
    total_op = sum(op_time.values())
    if stepped <= 0 or total_op <= 0:
        return None
    idle = max(0.0, 1.0 - busy / stepped)
    fractions = {k: (1.0 - idle) * t / total_op for k, t in op_time.items()}
    # Idle time is exposed communication only where the step ran collectives.
    fractions["comm_exposed" if ops["comm"] else "other"] = idle
    return fractions


SPLIT_PHASES = ("forward", "backward", "optimizer", "comm_exposed")


def split_records(
    records: list[dict[str, Any]], split: PhaseSplit | str
) -> tuple[list[dict[str, Any]], str]:
    """Each record's compiled time split by rank 0's sampled fractions (every rank runs
    the same step), or, without them (``split`` says why), the split phases None:
    not measured; the compiled time is each record's ``compiled_step_s`` either way.
    And what the summary's ``phases_source`` says of it."""
    for record in records:
        phases = record["phases_s"]
        fused = phases.pop(FUSED, 0.0)
        record[FUSED + "_s"] = fused
        if isinstance(split, str):
            phases.update(dict.fromkeys(SPLIT_PHASES))
            continue
        for phase, fraction in split.fractions.items():
            phases[phase] += fused * fraction
    if isinstance(split, str):
        return records, (
            "data_wait, ckpt_stall and other measured per step; forward, backward, "
            f"comm_exposed and optimizer not measured: {split}; the compiled step's "
            "whole time is compiled_step_s"
        )
    first = split.steps
    return records, (
        "data_wait, ckpt_stall and other measured per step; forward, backward, "
        "comm_exposed and optimizer split from each step's compiled time by a sampled "
        f"TensorFlow profile of steps {first[0]}-{first[1] - 1} on rank 0 "
        "(comm_exposed: time in the step when no compute op ran)"
    )
