"""Goodput: throughput discounted by the work that failures throw away.

A first-order model in the style of Young and Daly. Failures arrive at rate
1 / MTBF. Each one costs the time to notice it, restart and restore
(``restart_s``) plus the work done since the last *durable* checkpoint: on
average half an interval, plus the persist latency (a checkpoint counts only
once it is on disk). Without checkpoints that work is, on average, half the
job. The useful fraction of time is what is left:

    lost per failure   L = interval / 2 + persist + restart
    goodput            = throughput * max(0, 1 - L / MTBF)

The measured throughput already carries the checkpoints' own cost (stalls and
contention), so frequent checkpoints cost throughput and save rework: the
trade-off that makes "checkpointing off" lose when failures are frequent.
"""

from __future__ import annotations

from typing import Any


def lost_per_failure_s(
    interval_s: float | None, persist_s: float, restart_s: float, job_s: float
) -> float:
    """Seconds a failure costs; ``interval_s`` None: no checkpoints (half the job)."""
    if interval_s is None:
        return job_s / 2 + restart_s
    return interval_s / 2 + persist_s + restart_s


def goodput(throughput: float, lost_s: float, mtbf_s: float) -> float:
    return throughput * max(0.0, 1.0 - lost_s / mtbf_s)


def checkpoint_figures(summary: dict[str, Any]) -> tuple[float | None, float]:
    """(interval in seconds, mean persist latency in seconds) of a run's summary;
    the interval is None when the run took no checkpoints."""
    section = (summary.get("optimizations") or {}).get("checkpoint")
    if not section:
        return None, 0.0
    every = (section.get("auto_policy") or {}).get("interval") or section.get("every")
    return float(every) * summary["step_time_s"]["mean"], float(section["persist_s_mean"])
