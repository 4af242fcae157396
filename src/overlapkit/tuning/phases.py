"""What a study measures, phase by phase; `runner` runs each phase's trials.

1. probes (goodput studies whose checkpoint interval the model sets): the baseline
   checkpointing every few steps, until the cost of one checkpoint is known well
   enough for the model to be sure of its interval (`checkpoint_model`); every
   later trial checkpoints at that interval;
2. references: every optimization off, each alone along its level, all on at
   full level (the naive combination): the report's comparison rows;
3. search: ``tune.trials`` trials chosen by the sampler, in runs of
   ``tune.control_every`` with the control (the baseline) measured between them
   (the machine's drift, `drift`); each trial measures the window the reference
   trials' noise calls for (`window`);
4. confirm: the race (`race`): the search's finalists and the comparison rows
   side by side, in rounds, until the best is beyond the noise of the rest or
   ``tune.max_repeats`` rounds are done;
5. a probe of the pick (goodput studies): the checkpoint's cost with the tuned
   setting on, which may differ from its cost alone (they contend);
6. analysis: around the pick, one round side by side with it: each
   optimization's level swept with the others held (its contention curve),
   each pair on together, and the pick under each other policy.

Every phase counts what the study already holds, so a ``tune`` run again on a
stopped study goes on where it stopped and never queues a setting twice.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import combinations
from typing import Any

import optuna
from optuna.trial import TrialState

from .analysis import (
    CONTROL,
    PICK_PLAN_ATTR,
    PLAN_ATTR,
    PROBE,
    RACE,
    RACE_ATTR,
    SEARCH_STEPS_ATTR,
    Analysis,
    setting_key,
)
from .checkpoint_model import next_probe_every, plan_of
from .progress import StudyPlan
from .race import round_order
from .space import SearchSpace
from .study import COUNTED, TuneJob, queued_again, search_done, waiting
from .window import window

# run(heading, todo, counted): run the trials ``todo()`` says are left under
# ``heading`` (``counted``: the heading is a phase of the study's plan); False once
# the study must stop (out of time, Ctrl-C).
RunPhase = Callable[..., bool]
ANALYSIS_BLOCK = "analysis-1"


def run_phases(job: TuneJob, study: optuna.Study, run: RunPhase) -> None:
    queue = lambda: waiting(study)  # noqa: E731
    # Trials queued before this run that never ran (a run stopped in a queued phase):
    # under a heading of their own, not the next phase's.
    if not run("queued earlier", queue, False):
        return
    space, tune = job.space, job.tune
    free = {"scheduler.policy": "free"}
    if job.checkpoint_by_model and not _probe(job, study, run, space.setting(free), "alone"):
        return
    if tune.references:
        enqueue(study, reference_settings(space))
        if not run("references", queue):
            return
    if SEARCH_STEPS_ATTR not in study.user_attrs:
        references = _attrs(study, lambda t: t.user_attrs.get("role") != PROBE)
        study.set_user_attr(SEARCH_STEPS_ATTR, window(references, tune))
    if not _search(job, study, run):
        return
    if tune.repeats > 1 and not _race(job, study, run):
        return
    pick = Analysis.of(study, space, tune).center
    if pick is None:
        return
    if job.checkpoint_by_model and not _probe(job, study, run, pick.params, "pick"):
        return
    if tune.references:
        _analysis_round(job, study, run, pick.params)


# ---------------------------------------------------------------------- probes
def _probe(job: TuneJob, study: optuna.Study, run: RunPhase, params: dict, of: str) -> bool:
    """Probe trials of ``params`` (``of``: "alone", the baseline; "pick") until the
    model is sure of its interval or ``tune.probes`` have run; record the plan."""
    attr = PLAN_ATTR if of == "alone" else PICK_PLAN_ATTR
    key = setting_key(params)
    while True:
        # This setting's probes (a continued study may pick another), less those stopped
        # before their end (their copies run in their place).
        mine = [
            t
            for t in study.get_trials(deepcopy=False)
            if t.user_attrs.get("role") == PROBE
            and t.user_attrs.get("probe_of") == of
            and _key_of(t) == key
            and not queued_again(t)
        ]
        figures = {
            t.number: t.user_attrs["checkpoint"]
            for t in mine
            if t.state == TrialState.COMPLETE and t.user_attrs.get("checkpoint")
        }
        plan = plan_of(figures, job.tune)
        if plan is not None:
            study.set_user_attr(attr, plan.as_dict())
        every = next_probe_every(figures)
        # A probe measures a checkpoint whose busy steps end before the next: it needs
        # two intervals in its window (the longest a trial may run).
        fits = 2 * every <= job.tune.longest
        if (plan is not None and plan.sure) or len(mine) >= job.tune.probes or not fits:
            return True
        if not any(t.state == TrialState.WAITING for t in mine):
            if any(t.state == TrialState.RUNNING for t in mine):
                return True  # a probe runs elsewhere (another machine): go on with what is known
            attrs = {"probe_of": of, "probe_every": every, "steps": job.tune.longest}
            enqueue(study, [(PROBE, params)], again=True, attrs=attrs)
        heading = "probe: a checkpoint's cost" + (" with the pick" if of == "pick" else "")
        if not run(heading, lambda: waiting(study), of == "alone"):
            return False


# ---------------------------------------------------------------------- search
def _search(job: TuneJob, study: optuna.Study, run: RunPhase) -> bool:
    """The sampler's trials, with the control measured again after every
    ``tune.control_every`` of them."""
    searched = StudyPlan.search_trials(job.space, job.tune)
    every = job.tune.control_every
    control = job.space.setting({"scheduler.policy": "free"})
    while (done := search_done(study)) < searched:
        target = min(searched, (done // every + 1) * every) if every else searched
        left = lambda target=target: target - search_done(study)  # noqa: E731
        if not run("search", left, False):  # (the plan's bound holds the controls too)
            return False
        now = search_done(study)
        if now == done:  # nothing ran: the grid is done, or other machines filled the budget
            return True
        if every and now < searched and _controls(study) < now // every:
            # At the reference baseline's window: the controls compare with it alone.
            enqueue(study, [(CONTROL, control)], again=True, attrs={"steps": job.tune.steps})
            if not run("control", lambda: waiting(study), False):
                return False
    return True


def _controls(study: optuna.Study) -> int:
    """The controls measured, running or queued (one stopped before its end counts as
    its copy)."""
    return sum(
        1
        for t in study.get_trials(deepcopy=False)
        if t.user_attrs.get("role") == CONTROL and not queued_again(t)
    )


# ----------------------------------------------------------------------- race
def _race(job: TuneJob, study: optuna.Study, run: RunPhase) -> bool:
    """The confirm phase's rounds (see `race`)."""
    tune = job.tune
    race = study.user_attrs.get(RACE_ATTR)
    searched = search_done(study)
    if race is None or race.get("searched", searched) < searched:
        # The first race, or a study continued with more search trials (its finalists
        # may have changed): a race of its own, whose rounds add to the earlier ones.
        race = _start_race(job, study, (race or {}).get("generation", 0) + 1, searched)
    candidates = [dict(p) for p in race["candidates"]]
    if len(candidates) < 2:
        return True  # nothing to race
    steps = race["steps"]
    generation = race.get("generation", 1)
    prefix = "race" if generation == 1 else f"race{generation}"
    for round_ in range(1, tune.max_repeats + 1):
        done = round_ - 1
        status = Analysis.of(study, job.space, tune).race if done >= tune.repeats else None
        if status is not None and status.separated:
            return True
        out = set(status.out) if status is not None else set()
        alive = [p for p in candidates if setting_key(p) not in out]
        if len(alive) < 2:
            return True
        block = f"{prefix}-{round_}"
        have = _in_block(study, block)
        todo = [p for p in round_order(alive, done) if setting_key(p) not in have]
        for params in todo:
            attrs = {"block": block, "steps": steps[str(candidates.index(params))]}
            enqueue(study, [(RACE, params)], again=True, attrs=attrs)
        if not run(f"confirm round {round_}", lambda: waiting(study), round_ == 1):
            return False
    return True


def _start_race(
    job: TuneJob, study: optuna.Study, generation: int, searched: int
) -> dict[str, Any]:
    """Choose the race's settings (the search's finalists, after drift, and the
    comparison rows) and each one's window; recorded, so a continued study races
    the same ones."""
    analysis = Analysis.of(study, job.space, job.tune)
    finalists = [m.params for m in analysis.searched.ranked()[: job.tune.finalists]]
    rows = {}
    if job.tune.references:
        rows = {label: p for label, p, _ in analysis.reference_rows() if p and analysis.lookup(p)}
    candidates: dict[tuple[Any, ...], dict[str, Any]] = {}
    for params in [*finalists, *rows.values()]:
        candidates.setdefault(setting_key(params), params)
    settings = list(candidates.values())
    steps = {
        str(i): window([m.attrs for m in analysis.measurements(p)], job.tune)
        for i, p in enumerate(settings)
    }
    race = {
        "generation": generation,
        "searched": searched,  # the search trials done when it started
        "candidates": settings,
        "rows": rows,
        "alone": analysis.alone_best(),
        "steps": steps,
    }
    study.set_user_attr(RACE_ATTR, race)
    return race


def _in_block(study: optuna.Study, block: str) -> set[tuple[Any, ...]]:
    """The settings measured, running or queued in ``block``, or failed there for good
    (a setting that crashes is not queued in that round again)."""
    return {
        _key_of(t)
        for t in study.get_trials(deepcopy=False)
        if t.user_attrs.get("block") == block
        and (t.state in COUNTED or (t.state == TrialState.FAIL and not queued_again(t)))
    }


def _key_of(trial: Any) -> tuple[Any, ...]:
    """A trial's setting, whether it ran (its params) or waits (its queued params)."""
    return setting_key(trial.params or trial.system_attrs.get("fixed_params", {}))


# ------------------------------------------------------------------- analysis
def _analysis_round(job: TuneJob, study: optuna.Study, run: RunPhase, pick: dict) -> bool:
    """One round side by side with the pick: its contention curves, pairs, policies."""
    analysis = Analysis.of(study, job.space, job.tune)
    around = [("repeat:analysis", pick), *analysis_settings(job.space, pick, analysis.alone_best())]
    have = _in_block(study, ANALYSIS_BLOCK)
    steps = study.user_attrs.get(RACE_ATTR, {}).get("steps", {})
    candidates = study.user_attrs.get(RACE_ATTR, {}).get("candidates", [])
    seen = set(have)
    for role, params in around:
        key = setting_key(params)
        if key in seen:
            continue
        seen.add(key)
        attrs: dict[str, Any] = {"block": ANALYSIS_BLOCK}
        if params in candidates:  # the window it raced with
            attrs["steps"] = steps[str(candidates.index(params))]
        enqueue(study, [(role, params)], again=True, attrs=attrs)
    return run("analysis", lambda: waiting(study))


# ------------------------------------------------------------------- settings
def reference_settings(space: SearchSpace) -> list[tuple[str, dict[str, Any]]]:
    """Baseline, each optimization alone along its level, and all on at full level."""
    base = {"scheduler.policy": "free"}
    out = [("baseline", space.setting(base))]
    for name in space.optimizations:
        for value in space.level(name).values():
            params = space.setting(base, **{name: value})
            if space.is_on(params, name):
                out.append((f"alone:{name}", params))
    every = {name: "max" for name in space.optimizations}
    out.append(("all_on", space.setting(base, **every)))
    return out


def analysis_settings(
    space: SearchSpace, best: dict[str, Any], alone_best: dict[str, Any]
) -> list[tuple[str, dict[str, Any]]]:
    """Around the best setting: each level swept with the others held; each pair at
    its alone-best levels; the best setting under every other policy."""
    out = []
    for name in space.optimizations:
        level = space.level(name)
        for value in level.values():
            out.append((f"sweep:{name}", {**best, level.name: value}))
            if level.off_value is None and f"{name}.on" in best:
                out.append((f"sweep:{name}", {**best, f"{name}.on": False}))
    for a, b in combinations(space.optimizations, 2):
        if a in alone_best and b in alone_best:
            levels = {a: alone_best[a], b: alone_best[b]}
            out.append((f"pair:{a}+{b}", space.setting({"scheduler.policy": "free"}, **levels)))
    policy = next((d for d in space.dimensions if d.name == "scheduler.policy"), None)
    if policy is not None:
        for choice in policy.choices:
            if choice != best["scheduler.policy"]:
                out.append(("policy", {**best, "scheduler.policy": choice}))
    return out


def enqueue(
    study: optuna.Study,
    settings: list[tuple[str, dict[str, Any]]],
    again: bool = False,
    attrs: dict[str, Any] | None = None,
) -> None:
    """Queue ``settings`` (role, params), each with ``attrs``; unless ``again``, a
    setting already in the study (as a setting: a probe's checkpoints every few steps
    make it another) is not queued."""
    there = set() if again else _settings_in(study)
    for role, params in settings:
        if setting_key(params) not in there:
            study.enqueue_trial(params, user_attrs={"role": role, **(attrs or {})})


def _settings_in(study: optuna.Study) -> set[tuple[Any, ...]]:
    """The settings of the study's trials (queued, running or ended), probes aside."""
    return {
        setting_key(t.params or t.system_attrs.get("fixed_params", {}))
        for t in study.get_trials(deepcopy=False)
        if t.user_attrs.get("role") != PROBE
    }


def _attrs(study: optuna.Study, keep: Callable[[Any], bool]) -> list[dict[str, Any]]:
    """The attributes of the study's measured trials that ``keep`` keeps."""
    return [
        t.user_attrs
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if keep(t)
    ]
