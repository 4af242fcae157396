"""Where to cut a sequence of layers into pipeline stages.

`balanced` is PipeDream's dynamic program for a straight pipeline: it chooses
the contiguous stages that minimise the slowest stage's time per micro-batch,
counting a stage's compute (forward + backward) and the time to send its
output forward and receive that output's gradient back over the link.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .layers import SplitError


@dataclass(frozen=True)
class LayerCost:
    """One layer, measured on one micro-batch."""

    name: str
    compute_s: float  # forward + backward
    activation_bytes: int  # its output (what the next stage receives)
    param_bytes: int


def stage_time(costs: list[LayerCost], first: int, end: int, bytes_per_s: float) -> float:
    """Seconds per micro-batch for layers [first, end): compute plus, unless the stage
    is the last, sending its output and receiving the gradient of it."""
    compute = sum(c.compute_s for c in costs[first:end])
    transfer = 2 * costs[end - 1].activation_bytes / bytes_per_s if end < len(costs) else 0.0
    return compute + transfer


def balanced(costs: list[LayerCost], stages: int, bytes_per_s: float) -> list[int]:
    """The first layer of each stage, minimising the slowest stage (O(stages * n^2))."""
    n = len(costs)
    check_count(n, stages)
    inf = float("inf")
    # best[s][j]: the slowest of s stages holding layers [0, j); cut[s][j]: where the last starts.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                candidate = max(best[s - 1][i], stage_time(costs, i, j, bytes_per_s))
                if candidate < best[s][j]:
                    best[s][j], cut[s][j] = candidate, i
    starts, end = [], n
    for s in range(stages, 0, -1):
        end = cut[s][end]
        starts.append(end)
    return starts[::-1]


def equal_count(layers: int, stages: int) -> list[int]:
    """The same number of layers per stage (the first stages take the remainder)."""
    check_count(layers, stages)
    per, extra = divmod(layers, stages)
    starts, at = [], 0
    for s in range(stages):
        starts.append(at)
        at += per + (1 if s < extra else 0)
    return starts


def by_names(names: list[str], split_points: list[str], stages: int) -> list[int]:
    """Stages starting at the named layers (the first stage starts at the first layer)."""
    check_count(len(names), stages)
    if len(split_points) != stages - 1:
        raise SplitError(
            f"pipeline split names {len(split_points)} layers where stages begin; {stages} "
            f"stages need {stages - 1}"
        )
    unknown = [n for n in split_points if n not in names]
    if unknown:
        raise SplitError(
            f"pipeline split: no layer named {unknown[0]!r}; layers: {', '.join(names)}"
        )
    starts = [0, *(names.index(n) for n in split_points)]
    if any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
        raise SplitError(
            "pipeline split: the layers must be in forward order, after the first layer, "
            f"each once; got {', '.join(split_points)}"
        )
    return starts


def check_count(layers: int, stages: int) -> None:
    if stages > layers:
        raise SplitError(
            f"pipeline has {stages} stages but the model has only {layers} layers to split "
            "(each stage needs at least one)"
        )


def describe(costs: list[LayerCost], starts: list[int], bytes_per_s: float) -> list[dict[str, Any]]:
    """Per stage: its layers, predicted time per micro-batch, parameters, activation sent."""
    ends = [*starts[1:], len(costs)]
    return [
        {
            "stage": s,
            "layers": [c.name for c in costs[a:b]],
            "predicted_s": stage_time(costs, a, b, bytes_per_s),
            "compute_s": sum(c.compute_s for c in costs[a:b]),
            "param_bytes": sum(c.param_bytes for c in costs[a:b]),
            "sends_bytes": costs[b - 1].activation_bytes if b < len(costs) else 0,
        }
        for s, (a, b) in enumerate(zip(starts, ends, strict=True))
    ]


def as_dicts(costs: list[LayerCost]) -> list[dict[str, Any]]:
    return [asdict(c) for c in costs]
