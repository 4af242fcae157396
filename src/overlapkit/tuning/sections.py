"""The report's sections on how the answer was reached: the race that chose the
pick, the machine's drift over the study, and the checkpoint interval's model
(its formula and every input). Each is plain data for ``report.json`` and a
sentence for the terminal and ``report.md``."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Any

from .analysis import PICK_PLAN_ATTR, RACE, Analysis, setting_key
from .checkpoint_model import CheckpointPlan
from .space import short_setting

RULE = (
    "among the settings within noise of the race's best, the simplest: the fewest "
    "optimizations on, then the lowest levels, then the plainer policy (free, priority, "
    "partition) with its knobs at their first values"
)


def race_section(analysis: Analysis) -> dict[str, Any] | None:
    status, fit = analysis.race, analysis.searched.paired
    if status is None or fit is None or analysis.best is None:
        return None
    blocks = {m.block for m in analysis.measured if m.role == RACE}
    return {
        "rounds": len(blocks),
        "settings": len({*status.equivalent, *status.out}),
        "judged": status.judged,
        "separated": status.separated,
        "best": analysis.params_of(status.best),
        "pick": analysis.best.params,
        "equivalent": [analysis.params_of(k) for k in status.equivalent],
        "out": [analysis.params_of(k) for k in status.out],
        "noise": fit.sigma,
        "df": fit.df,
        "bound": fit.bound if fit.sigma is not None else None,
        "rule": RULE,
    }


def race_text(race: dict[str, Any] | None) -> str | None:
    if race is None:
        return None
    head = f"The race ({race['rounds']} round(s) side by side, {race['settings']} settings)"
    pick = short_setting(race["pick"])
    if not race["judged"]:
        return f"{head}: one round, so nothing is told apart yet; the pick is its best, {pick}"
    if race["separated"]:
        return f"{head}: the pick, {pick}, is ahead of every other setting beyond the noise"
    others = [short_setting(p) for p in race["equivalent"] if p != race["pick"]]
    return (
        f"{head}: these {len(race['equivalent'])} settings are equivalent (within noise of "
        f"the best, {short_setting(race['best'])}): {pick}; " + "; ".join(others)
        + f". The simplest is {pick} (the rule: {RULE})"
    )


def drift_section(analysis: Analysis) -> dict[str, Any] | None:
    drift = analysis.drift
    if drift is None:
        return None
    fit = analysis.paired
    rounds = []
    if fit is not None:
        # Each round's effect: the machine's speed then, as the control's value in that
        # round relative to the control's mean outside the rounds (when the control was
        # measured side by side), else relative to the rounds' mean.
        control = setting_key(analysis.space.setting({"scheduler.policy": "free"}))
        mean = statistics.fmean(drift.values)
        if control in fit:
            level = {b: math.exp(fit.effect(control) + e) / mean for b, e in fit.rounds.items()}
        else:
            middle = statistics.fmean(fit.rounds.values())
            level = {b: math.exp(e - middle) for b, e in fit.rounds.items()}
        starts: dict[str, list[float]] = {}
        for m in analysis.measured:
            if m.block in fit.rounds and m.started is not None:
                starts.setdefault(m.block, []).append(m.started)
        for block in fit.rounds:
            if block in starts:
                when = statistics.fmean(starts[block]) - drift.start_s
                rounds.append({"round": block, "at_s": when, "speed": level[block]})
    return {
        "controls": len(drift.values),
        "points": [[t, v] for t, v in zip(drift.times_s, drift.values, strict=True)],
        "change": drift.change,
        "spread": drift.spread,
        "significant": drift.significant,
        "slope_per_hour": drift.slope * 3600,
        "slope_se_per_hour": None if drift.slope_se is None else drift.slope_se * 3600,
        "residual_sigma": drift.residual_sigma,
        "rounds": rounds,
    }


def drift_text(drift: dict[str, Any] | None) -> str | None:
    if drift is None:
        return None
    minutes = drift["points"][-1][0] / 60
    move = f"{drift['change']:+.1%}"
    if drift["significant"]:
        return (
            f"The machine drifted: the control (the baseline), measured {drift['controls']} "
            f"times over {minutes:.0f} min, moved {move} along its line, beyond the noise; the "
            "measurements outside the side-by-side rounds are corrected by it before the "
            "finalists are chosen"
        )
    return (
        f"No drift beyond the noise: the control (the baseline), measured "
        f"{drift['controls']} times over {minutes:.0f} min, moved {move} along its line "
        f"(its values {drift['spread']:.1%} apart); nothing is corrected"
    )


def checkpoint_section(analysis: Analysis) -> dict[str, Any] | None:
    """The model's interval: the plan from the probes alone (which every trial used)
    and, when probed, the one from the checkpoint's cost with the pick on (which
    best.yaml uses)."""
    plan = analysis.plan
    if plan is None:
        return None
    recorded = analysis.study.user_attrs.get(PICK_PLAN_ATTR)
    pick = None
    if recorded:
        pick = replace(
            CheckpointPlan.from_dict(recorded),
            mtbf_s=plan.mtbf_s,
            restart_s=plan.restart_s,
            job_s=plan.job_s,
        )
    chosen = pick if pick is not None and pick.measured else plan
    return {
        "alone": plan.as_dict(),
        "with_pick": None if pick is None else pick.as_dict(),
        "every": chosen.every if chosen.on else None,
        "trials_every": plan.every if plan.on else None,
    }


def checkpoint_text(section: dict[str, Any] | None) -> list[str]:
    if section is None:
        return []
    alone, pick = section["alone"], section["with_pick"]
    lines = [
        f"One checkpoint costs the steps {_ms(alone['cost_s'])}"
        + (f" +- {_ms(alone['cost_se'])}" if alone["cost_se"] else "")
        + (
            " (measured by probe trial(s) "
            + ", ".join(map(str, alone["probes"]))
            + ": its stall and the slow-down while it persists)"
            if alone["measured"]
            else " (an upper bound, stall + persist: no probe could measure it, its persists "
            "outlasting the intervals that fit twice in a trial; raise tune.max_steps)"
        )
        + (f"; with the pick on, {_ms(pick['cost_s'])}" if pick and pick["measured"] else "")
        + "."
    ]
    hours = alone["mtbf_s"] / 3600
    lines.append(
        f"Daly's interval at an MTBF of {hours:g} h: W* = sqrt(2 C M) (1 + sqrt(C/2M)/3 + "
        f"C/18M) - C = {alone['interval_s']:.1f} s of work (Young's sqrt(2 C M): "
        f"{alone['young_interval_s']:.1f} s), every {alone['every']} steps of "
        f"{_ms(alone['step_s'])}."
    )
    if alone["every_range"] is not None:
        low, high = alone["every_range"]
        sure = "the model is sure" if alone["sure"] else "the model is not sure"
        lines.append(
            f"The cost's range (C +- 2 standard errors) would choose every {low} to {high} "
            f"steps, costing at most {alone['worst_loss']:.2%} goodput: {sure}."
        )
    keeps, without = alone["efficiency"], alone["efficiency_without"]
    decision = "checkpoints pay" if alone["on"] else "checkpoints do not pay: off"
    lines.append(
        f"Goodput keeps {keeps:.1%} of the throughput at that interval and {without:.1%} "
        f"without checkpoints ({alone['job_s'] / 3600:g} h job, {alone['restart_s']:g} s "
        f"restart): {decision}. {_ran_at(section['trials_every'], 'Every trial ran')}"
        + (
            f"; {_ran_at(section['every'], 'best.yaml runs')} (from the pick's own cost)"
            if section["every"] != section["trials_every"]
            else ""
        )
        + "."
    )
    return lines


def _ran_at(every: int | None, who: str) -> str:
    return f"{who} without checkpoints" if every is None else f"{who} at every {every}"


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1e3:.1f} ms"
