"""How often to checkpoint, from a model and a measured cost, not from a search.

With failures every M seconds on average, a checkpoint that costs C seconds of
the steps' time and work W done between checkpoints, a segment takes W + C and a
failure throws away on average half a segment plus the restart. Goodput is
best at Daly's interval (Daly 2006, "A higher order estimate of the optimum
checkpoint interval for restart dumps"), to first order Young's sqrt(2 C M):

    W* = sqrt(2 C M) * (1 + sqrt(C / (2 M)) / 3 + C / (18 M)) - C    (C < 2 M; else M)

It does not depend on the restart time. C is measured by *probe* trials: a
trial that checkpoints every few steps, whose run measures each checkpoint's
cost as the time its busy steps took beyond its clean steps (`CheckpointCost`
in the checkpoint optimization: the stall plus the slow-down while it persists,
in the same run, so a drifting machine hits both alike). Near W* goodput is flat
(an interval 20 % off costs about 2 % of the checkpoints' small share), so the
model is *sure* when the ends of the cost's range (C +- 2 standard errors) move
goodput at the chosen interval by less than `SURE`; otherwise, or when no cost
could be measured, more probes run: after a probe whose persists left no step
clean, one that checkpoints less often; after one whose cost is too uncertain,
another alike.

Every other trial checkpoints at W* and is priced alike (`CheckpointPlan.price`):
a trial of a few dozen steps takes no checkpoint at an interval of hundreds, and
one whose window holds a checkpoint or two has their cost (the model's) taken
out of its time; then each segment of W* pays the cost C (see
`goodput.efficiency`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from .config import TuneConfig
from .goodput import efficiency

SURE = 0.01  # the model is sure when the cost's range moves goodput by less than this
PROBE_EVERY = 4  # the first probe's interval (steps): room for a persist and clean steps


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's interval, sqrt(2 C M): seconds of work between checkpoints."""
    return math.sqrt(2 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order interval (seconds of work between checkpoints)."""
    if cost_s <= 0:
        return 0.0
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2 * mtbf_s)
    return young_interval(cost_s, mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost_s


@dataclass(frozen=True)
class CheckpointPlan:
    """The interval the model chose, with every input it was chosen from."""

    cost_s: float  # one checkpoint's cost to the steps
    cost_se: float | None  # its standard error (None: one window, or an upper bound)
    measured: bool  # False: no probe measured a cost; the upper bound stall + persist
    persist_s: float  # until a checkpoint is durable
    step_s: float  # a clean step's time, which the interval is counted in
    mtbf_s: float
    restart_s: float
    job_s: float
    probes: tuple[int, ...] = field(default=())  # the probe trials it came from

    @property
    def interval_s(self) -> float:
        return daly_interval(self.cost_s, self.mtbf_s)

    @property
    def every(self) -> int:
        """The interval in steps."""
        return steps_of(self.interval_s, self.step_s)

    def efficiency_at(
        self, every: int | None, cost_s: float | None = None, step_s: float | None = None
    ) -> float:
        """The share of the throughput goodput keeps with checkpoints every ``every``
        steps (None: none) of ``step_s`` (default: the probes' clean step), each costing
        ``cost_s`` (default: the measured cost)."""
        cost = self.cost_s if cost_s is None else cost_s
        step = self.step_s if step_s is None else step_s
        interval = None if every is None else every * step
        return efficiency(interval, self.persist_s, self.restart_s, self.mtbf_s, self.job_s, cost)

    def price(self, throughput: float, runtime_s: float, steps: int, taken: int) -> dict[str, float]:
        """A trial's goodput at this plan: its throughput without the ``taken``
        checkpoints that fell inside its ``steps`` measured steps (each the plan's cost,
        taken out), then a checkpoint every `every` steps, each costing the plan's
        cost, against the failures. So every trial is priced alike, whether its window
        held a checkpoint at the interval or not."""
        clean_s = max(runtime_s - taken * self.cost_s, 0.5 * runtime_s)
        clean = throughput * runtime_s / clean_s if clean_s > 0 else throughput
        every = self.every if self.on else None
        share = self.efficiency_at(every, step_s=clean_s / steps if steps else self.step_s)
        return {"clean_throughput": clean, "share": share, "goodput": clean * share}

    @property
    def on(self) -> bool:
        """Checkpoints pay: goodput at the interval beats goodput without any."""
        return self.efficiency_at(self.every) > self.efficiency_at(None)

    def cost_range(self) -> tuple[float, float] | None:
        if self.cost_se is None:
            return None
        return max(
            self.cost_s - 2 * self.cost_se, self.cost_s * 0.01
        ), self.cost_s + 2 * self.cost_se

    def every_range(self) -> tuple[int, int] | None:
        """The intervals (steps) the ends of the cost's range would choose."""
        costs = self.cost_range()
        if costs is None:
            return None
        low, high = (steps_of(daly_interval(c, self.mtbf_s), self.step_s) for c in costs)
        return low, high

    def worst_loss(self) -> float | None:
        """The most goodput the chosen interval loses, were the cost at either end of
        its range, against that end's own best interval (0.001 = 0.1 %)."""
        costs = self.cost_range()
        if costs is None:
            return None
        losses = []
        for cost in costs:
            own = steps_of(daly_interval(cost, self.mtbf_s), self.step_s)
            best = self.efficiency_at(own, cost)
            losses.append(1 - self.efficiency_at(self.every, cost) / best if best > 0 else 0.0)
        return max(losses)

    @property
    def sure(self) -> bool:
        loss = self.worst_loss()
        return self.measured and loss is not None and loss < SURE

    def as_dict(self) -> dict[str, Any]:
        """Everything a report says of the decision, with the inputs."""
        return {
            **asdict(self),
            "probes": list(self.probes),
            "interval_s": self.interval_s,
            "young_interval_s": young_interval(self.cost_s, self.mtbf_s),
            "every": self.every,
            "every_range": self.every_range(),
            "worst_loss": self.worst_loss(),
            "sure": self.sure,
            "on": self.on,
            "efficiency": self.efficiency_at(self.every),
            "efficiency_without": self.efficiency_at(None),
            "formula": "W* = sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + C / 18M) - C (Daly)",
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckpointPlan:
        names = set(cls.__dataclass_fields__)
        plan = {k: v for k, v in data.items() if k in names}
        plan["probes"] = tuple(plan.get("probes", ()))
        return cls(**plan)


def taken_in_window(every: int | None, warmup: int, steps: int) -> int:
    """Checkpoints a run of fixed interval ``every`` took within its measured steps
    (warm-up steps ``warmup`` to ``warmup + steps - 1``: one is due at each multiple)."""
    if not every:
        return 0
    return (warmup + steps - 1) // every - (warmup - 1) // every


def steps_of(interval_s: float, step_s: float) -> int:
    return max(1, round(interval_s / step_s)) if step_s > 0 else 1


def probe_cost(summary: dict[str, Any]) -> dict[str, Any] | None:
    """A probe run's checkpoint figures: cost (and its standard error and windows),
    persist time, stall, clean step time and the interval it ran at; None when it
    ran without checkpoints."""
    section = (summary.get("optimizations") or {}).get("checkpoint")
    if not section:
        return None
    return {
        "cost_s": section.get("cost_s_mean"),
        "cost_se": section.get("cost_s_se"),
        "windows": section.get("cost_windows", 0),
        "persist_s": section.get("persist_s_mean", 0.0),
        "stall_s": section.get("stall_s_mean", 0.0),
        "step_s": section.get("clean_step_s") or summary["step_time_s"]["mean"],
        "every": section.get("every"),
        "note": section.get("cost_note"),
    }


def plan_of(probes: dict[int, dict[str, Any]], tune: TuneConfig) -> CheckpointPlan | None:
    """The plan from probe trials' figures (trial number -> `probe_cost`): their costs
    pooled by windows measured. With no cost measured, the upper bound stall +
    persist (as if training waited for every persist), marked not measured."""
    if not probes:
        return None
    figures = list(probes.values())
    measured = [p for p in figures if p["cost_s"] is not None and p["windows"]]
    windows = sum(p["windows"] for p in measured)
    persist = sum(p["persist_s"] for p in figures) / len(figures)
    step = sum(p["step_s"] for p in figures) / len(figures)
    if measured:
        cost = sum(p["cost_s"] * p["windows"] for p in measured) / windows
        # The pooled mean's error: each probe's error weighted by its share of windows.
        se = None
        if all(p["cost_se"] is not None for p in measured):
            se = math.sqrt(sum((p["windows"] * p["cost_se"]) ** 2 for p in measured)) / windows
        elif len(measured) > 1:  # a probe of one window: the probes' own spread
            se = statistics.stdev(p["cost_s"] for p in measured) / math.sqrt(len(measured))
        # A cost at or below zero (the noise, when checkpoints cost nothing measurable):
        # a floor of one stall, which every checkpoint pays.
        floor = max(p["stall_s"] for p in figures)
        cost = max(cost, floor, 1e-6)
    else:
        cost = max(p["stall_s"] + p["persist_s"] for p in figures)
        se = None
    return CheckpointPlan(
        cost_s=cost,
        cost_se=se,
        measured=bool(measured),
        persist_s=persist,
        step_s=step,
        mtbf_s=tune.mtbf_hours * 3600,
        restart_s=tune.restart_s,
        job_s=tune.job_hours * 3600,
        probes=tuple(sorted(probes)),
    )


def next_probe_every(probes: dict[int, dict[str, Any]]) -> int:
    """The next probe's interval: the first at `PROBE_EVERY`; after a probe whose
    persists left no step clean, twice its interval plus the steps a persist took."""
    if not probes:
        return PROBE_EVERY
    last = probes[max(probes)]
    every = int(last["every"] or PROBE_EVERY)
    if last["cost_s"] is None:
        busy = math.ceil(last["persist_s"] / last["step_s"]) if last["step_s"] else every
        return 2 * every + busy
    return every
