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
is split: the compiled time stays in ``compiled_step`` and the summary says so.
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
    else the first measured ones; None when the run has too few steps, and on every
    rank but 0 (TensorFlow's profiler in two processes of one cluster at once
    crashed a worker: "double free or corruption")."""
    if rank != 0:
        return None
    if warmup_steps >= 2:
        first = max(1, warmup_steps - WINDOW_STEPS)
        window = ProfileWindow(first, warmup_steps, rank)
    else:
        window = ProfileWindow(
            max(1, warmup_steps), min(total_steps, max(1, warmup_steps) + WINDOW_STEPS), rank
        )
    if window.start < start or window.stop <= window.start:
        return None
    return window


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


OPTIMIZER_SCOPES = ("sgd", "adam", "adamw", "loss_scale_optimizer")


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
    records: list[dict[str, Any]], splits: list[PhaseSplit]
) -> tuple[list[dict[str, Any]], str]:
    """Each record's compiled time split by the sampled fractions (or counted in
    ``other`` without any); and what the summary says of it."""
    split = splits[0] if splits else None  # rank 0's: every rank runs the same step
    for record in records:
        phases = record["phases_s"]
        fused = phases.pop(FUSED, 0.0)
        record[FUSED + "_s"] = fused
        if split is None:
            phases["other"] += fused
            continue
        for phase, fraction in split.fractions.items():
            phases[phase] += fused * fraction
    if not splits:
        return records, (
            "data_wait, ckpt_stall and other measured per step; the compiled step "
            "(forward, backward, all-reduce, optimizer) could not be split: too few steps "
            "to profile, so its time is counted in other (see compiled_step_s)"
        )
    first = splits[0].steps
    return records, (
        "data_wait, ckpt_stall and other measured per step; forward, backward, "
        "comm_exposed and optimizer split from each step's compiled time by a sampled "
        f"TensorFlow profile of steps {first[0]}-{first[1] - 1} on rank 0 "
        "(comm_exposed: time in the step when no compute op ran)"
    )
