"""What ``overlapkit check`` shows: every section of a scenario as it will run, one
setting a line (``auto`` beside what it resolves to here; an optimization's knobs
as its intensity and the file make them, marked where the file sets them; the
tune section and the space it searches). No result fields: nothing has run."""

from __future__ import annotations

from typing import Any

from ..runtime.optimization import engine_for, number_in, settings_on
from ..runtime.policies import POLICIES
from ..tuning.space import SpaceError, build_space, checkpoint_by_model, runnable_search
from .config import Scenario

AT_START = "decided at start"
# What an unset (None) value means, where "decided at start" would not say it.
UNSET = {
    "eval.max_samples": "all of the evaluation set",
    "tensorboard": "off",
    "storage": "SQLite in the tune folder",
    "study": "the scenario's name",
    "threads": "cores / ranks on each machine (decided at start)",
}


def describe(scenario: Scenario) -> list[tuple[str, list[tuple[str, str]]]]:
    """(section, [(setting, value)]) in the order of a scenario file."""
    sections = [
        ("scenario", [("name", scenario.name), ("framework", scenario.framework)]),
        ("model", _flat(scenario.model.model_dump(mode="json"))),
        ("data", _flat(scenario.data.model_dump(mode="json"))),
        ("train", _flat(scenario.train.model_dump(mode="json"))),
        ("world", _world(scenario)),
    ]
    for optimization in scenario.build_optimizations():
        rows = []
        for knob, value in _settings_as_run(optimization, scenario).items():
            set_here = knob in optimization.explicit
            given = optimization.explicit.get(knob)
            if (
                isinstance(given, str)
                and not isinstance(value, str)
                and isinstance(number_in(given), str)
            ):
                value = given  # a word the knob stands for (every: auto), not its number
            rows.append((knob, _text(value) + ("  (set)" if set_here else "")))
        sections.append((f"optimizations.{optimization.name}", rows))
    if not scenario.optimizations:
        sections.append(("optimizations", [("(none)", "a plain loop")]))
    sections.append(("scheduler", _scheduler(scenario)))
    sections.append(("log", _flat(scenario.log.model_dump(mode="json"))))
    sections.append(("tune", _tune(scenario)))
    return sections


def _settings_as_run(optimization: Any, scenario: Scenario) -> dict[str, Any]:
    """Its settings as ``scenario.framework`` runs them (an engine may resolve some:
    TensorFlow's prefetch always reads through tf.data)."""
    if scenario.framework == "torch" or optimization.why_not_on(scenario.framework):
        return settings_on(optimization, scenario.framework)
    engine = engine_for(optimization, scenario.framework)
    if not hasattr(engine, "shown_settings"):
        return settings_on(optimization, scenario.framework)
    return engine.shown_settings(scenario.device_type)


def _scheduler(scenario: Scenario) -> list[tuple[str, str]]:
    """The policy and trace; under partition, each of its knobs as it will run."""
    scheduler = scenario.scheduler
    policy_shown = scheduler.policy
    if scenario.framework == "tensorflow" and scheduler.policy == "priority":
        policy_shown = "priority (runs as free: a compiled step says no waits)"
    rows = [("policy", policy_shown), ("trace", _text(scheduler.trace))]
    if scheduler.policy == "partition":
        policy = POLICIES["partition"]
        values = policy.resolve(scheduler.partition)
        for knob in policy.knobs:
            value = values[knob.name]
            shown = "from the profile" if value is None else _text(value)
            rows.append(
                (
                    f"partition.{knob.name}",
                    shown + ("  (set)" if knob.name in scheduler.partition else ""),
                )
            )
    return rows


def _world(scenario: Scenario) -> list[tuple[str, str]]:
    world = scenario.world
    rows = _flat(world.model_dump(mode="json"))
    resolved = {"device": scenario.device_type, "backend": scenario.backend}
    out = []
    for key, value in rows:
        if key in resolved and value == "auto":
            value = f"auto -> {resolved[key]} here"
        out.append((key, value))
    return out


def _tune(scenario: Scenario) -> list[tuple[str, str]]:
    rows = [(k, v) for k, v in _flat(scenario.tune.model_dump(mode="json")) if k != "search"]
    if scenario.framework == "tensorflow" and scenario.tune.policy:
        rows = [(k, "no: TensorFlow runs one policy" if k == "policy" else v) for k, v in rows]
    if scenario.tune.search is None:
        rows.insert(0, ("search", "each optimization above by its intensity"))
    optimizations = scenario.optimizations
    search, narrowed = runnable_search(
        scenario.tune.search,
        optimizations,
        scenario.setup,
        scenario.framework,
    )
    tune = scenario.tune.model_copy(update={"search": search})
    if not optimizations:  # as `tune` does: every built-in one that applies
        chosen, left_out = scenario.applicable_optimizations()
        optimizations = {name: None for name in chosen}
        rows.append(("space: chosen", ", ".join(chosen) or "none applies"))
        rows += [(f"space: left out {name}", why) for name, why in left_out.items()]
    rows += [("space: narrowed", note) for note in narrowed]
    try:
        space = build_space(optimizations, tune, scenario.framework)
    except SpaceError as error:
        rows.append(("space", str(error)))
        return rows
    for dimension in space.dimensions:
        rows.append((f"space: {dimension.name}", ", ".join(map(_text, dimension.values()))))
    if checkpoint_by_model(optimizations, tune):
        rows.append(("space: checkpoint", "its interval from the goodput model (Young/Daly, measured cost)"))
    rows.append(("space: grid size", str(space.grid_size())))
    return rows


def _flat(data: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    rows = []
    for key, value in data.items():
        if isinstance(value, dict) and value:
            rows += _flat(value, f"{prefix}{key}.")
        else:
            name = f"{prefix}{key}"
            unset = UNSET.get(name, UNSET.get(key)) if value is None else None
            rows.append((name, unset or _text(value)))
    return rows


def _text(value: Any) -> str:
    if value is None:
        return AT_START
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_text(v) for v in value) + "]" if value else "[]"
    if isinstance(value, dict):
        return "{}"
    return str(value)
