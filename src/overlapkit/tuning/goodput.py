"""Goodput: throughput discounted by the work that failures throw away.

Failures arrive at rate λ = 1 / MTBF. Work is made safe in segments: τ of
work between checkpoints (without checkpoints, the whole job), plus C, what a
checkpoint costs the steps. A failure costs the work done since the segment
began, plus the time to notice it, restart and restore (``restart_s``), plus
the persist latency p (a checkpoint counts only once it is durable). The
expected time to get one segment done is then (Daly's model, first order in
R + p)

    E[T] = (1/λ + restart + p) · (exp(λ·(τ + C)) − 1)

and goodput = throughput · τ / E[T]. For τ ≪ MTBF this is the familiar
throughput · (1 − (τ/2 + p + restart) / MTBF − C/τ); without checkpoints a long
job gets almost nothing done (a 4 h job at a 1 h MTBF: 7 % of the throughput).

A trial's measured throughput carries the cost of the checkpoints it took (C =
0 here); one priced at the model's interval (`checkpoint_model`), which a short
trial cannot hold, pays C per segment instead. Frequent checkpoints cost
throughput and save rework: the trade-off that makes "checkpointing off" lose
when failures are frequent, and that Young's and Daly's intervals balance.
"""

from __future__ import annotations

import math
from typing import Any

from .config import TuneConfig


def efficiency(
    interval_s: float | None,
    persist_s: float,
    restart_s: float,
    mtbf_s: float,
    job_s: float,
    cost_s: float = 0.0,
) -> float:
    """The share of the throughput that survives failures; ``interval_s`` None: no
    checkpoints (the whole job is one segment). ``cost_s``: what each checkpoint adds
    to a segment's time, when the throughput does not already carry it (a trial too
    short to take a checkpoint at the interval: the model's cost, measured apart)."""
    segment = job_s if interval_s is None else interval_s + cost_s
    work = job_s if interval_s is None else interval_s
    extra = restart_s + (0.0 if interval_s is None else persist_s)
    rate = 1.0 / mtbf_s
    try:
        expected = (mtbf_s + extra) * math.expm1(rate * segment)
    except OverflowError:
        return 0.0
    return work / expected if expected > 0 else 1.0


def goodput(throughput: float, efficiency_: float) -> float:
    return throughput * efficiency_


def priced_efficiency(
    interval_s: float | None, persist_s: float, tune: TuneConfig, cost_s: float = 0.0
) -> float:
    """`efficiency` at ``tune``'s MTBF, restart time and job length."""
    return efficiency(
        interval_s,
        persist_s,
        tune.restart_s,
        tune.mtbf_hours * 3600,
        tune.job_hours * 3600,
        cost_s,
    )


def checkpoint_figures(summary: dict[str, Any]) -> tuple[float | None, float]:
    """(interval in seconds, mean persist latency in seconds) of a run's summary;
    the interval is None when the run did not checkpoint (in auto mode: when it never
    chose an interval, not the unused ``every``)."""
    section = (summary.get("optimizations") or {}).get("checkpoint")
    if not section:
        return None, 0.0
    auto = section.get("auto_policy")
    every = auto["interval"] if auto is not None else section.get("every")
    if every is None:
        return None, 0.0
    return float(every) * summary["step_time_s"]["mean"], float(section["persist_s_mean"])


def checkpoints_taken(summary: dict[str, Any]) -> int | None:
    """How many checkpoints the run took; None when it does not checkpoint. With 0,
    the checkpoints' cost is missing from its throughput."""
    section = (summary.get("optimizations") or {}).get("checkpoint")
    return int(section.get("checkpoints", 0)) if section else None
