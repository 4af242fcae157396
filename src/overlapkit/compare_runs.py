"""``overlapkit compare RUN_DIR...``: finished runs side by side.

A table (throughput and its ratio to the first run, step time, each phase per
step, the POP metrics and each optimization's key figures, as the optimization
declares them), ``compare.json`` for machines and ``phases.png``: a stacked bar
per run of where each step's time went."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from rich.table import Table

from .folders import new_stamped
from .optimizations import get_optimization
from .runtime import KnobError
from .runtime.plain_data import value_at
from .tuning.plots import plt, save_figure

POP = {
    "load_balance": "load balance",
    "communication_efficiency": "communication efficiency",
    "parallel_efficiency": "parallel efficiency",
}


TUNE_FILE = "tune.json"  # a tune folder's (tuning.study's; not imported: optuna with it)


class RunFolderError(ValueError):
    """A folder that holds no finished run."""


def load_run(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "summary.json"
    if Path(folder).is_file():
        raise RunFolderError(f"{folder}: a file; name a run folder (one holding summary.json)")
    if not Path(folder).is_dir():
        raise RunFolderError(f"{folder}: no such folder")
    if not path.is_file() and (Path(folder) / TUNE_FILE).is_file():
        raise RunFolderError(
            f"{folder}: a tune folder, not a run's; compare its trials' runs "
            f"({Path(folder) / 'trials' / 'NUMBER' / 'run'}), or studies with "
            "overlapkit report --compare"
        )
    if not path.is_file():
        raise RunFolderError(
            f"{folder}: no summary.json (not a run folder, or a run that did not finish)"
        )
    try:
        summary = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RunFolderError(f"{path}: not valid JSON ({error})") from None
    except OSError as error:
        raise RunFolderError(f"{path}: cannot be read ({error.strerror or error})") from None
    missing = [key for key in NEEDED if not isinstance(summary, dict) or key not in summary]
    if missing:
        raise RunFolderError(
            f"{path}: not an overlapkit run summary (it lacks {', '.join(missing)})"
        )
    if not isinstance(summary["step_time_s"], dict):
        raise RunFolderError(f"{path}: not an overlapkit run summary (step_time_s is no table)")
    if summary["samples_per_s"] is None and summary.get("steps") == 0:
        raise RunFolderError(
            f"{path}: the run measured no step (every step it ran was warm-up: resumed at "
            "its last?), so it has nothing to compare"
        )
    tables = {"pop": summary.get("pop", {}), "optimizations": summary.get("optimizations", {})}
    if isinstance(tables["optimizations"], dict):
        tables |= {f"optimizations.{n}": s for n, s in tables["optimizations"].items()}
    for key, table in tables.items():  # read with .get: a table, or compare fails
        if not isinstance(table, dict):
            raise RunFolderError(
                f"{path}: not an overlapkit run summary ({key} is {json.dumps(table)}, not a table)"
            )
    phases = summary.get("phases_s", {})
    figures = {
        "samples_per_s": summary["samples_per_s"],
        "step_time_s.p50": summary["step_time_s"].get("p50"),
        **({f"phases_s.{k}": v for k, v in phases.items()} if isinstance(phases, dict) else {}),
        **{f"pop.{key}": summary.get("pop", {}).get(key) for key in POP},
    }
    if not isinstance(phases, dict):
        figures["phases_s"] = phases
    for key, value in figures.items():
        if value is None and key.startswith(("phases_s.", "pop.")):
            continue  # a phase the run did not measure, a figure it could not
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise RunFolderError(
                f"{path}: not an overlapkit run summary ({key} is {json.dumps(value)}, "
                "not a number)"
            )
    return summary


NEEDED = ("samples_per_s", "step_time_s")  # what every comparison row reads


def compare_document(folders: list[Path]) -> dict[str, Any]:
    summaries = [load_run(folder) for folder in folders]
    labels = _labels(folders)
    phases = list(dict.fromkeys(p for s in summaries for p in s.get("phases_s", {})))
    first = summaries[0]["samples_per_s"]
    runs = []
    for folder, label, summary in zip(folders, labels, summaries, strict=True):
        runs.append(
            {
                "label": label,
                "run_dir": str(folder),
                "name": summary.get("name"),
                "framework": summary.get("framework", "torch"),
                "world_size": summary.get("world_size"),
                "steps": summary.get("steps"),
                "resumed_from_step": _resumed_from(summary),
                "samples_per_s": summary["samples_per_s"],
                "vs_first": summary["samples_per_s"] / first if first else None,
                "step_ms_p50": summary["step_time_s"]["p50"] * 1e3,
                # No phases at all: not measured (n/a), not zero; a phase one run lacks
                # is one it never spent time in.
                "phases_ms": {
                    p: _times_1000(summary["phases_s"].get(p, 0.0))
                    if "phases_s" in summary
                    else None
                    for p in phases
                },
                "phases_source": summary.get("phases_source"),
                "phases_profiled_steps": summary.get("phases_profiled_steps"),
                "pop": {key: summary.get("pop", {}).get(key) for key in POP},
                "optimizations": {
                    name: key_figures(name, section)
                    for name, section in summary.get("optimizations", {}).items()
                },
            }
        )
    return {"runs": runs, "phases": phases}


def key_figures(name: str, section: dict[str, Any]) -> dict[str, Any]:
    """The figures ``name`` declares as its key ones, read from its summary section."""
    try:
        declared = get_optimization(name).key_figures
    except KnobError:  # a plug-in this installation lacks: its intensity only
        declared = {}
    out: dict[str, Any] = {"intensity": section.get("intensity")}
    for label, paths in declared.items():
        out[label] = next(
            (value for path in paths if (value := value_at(section, path)) is not None), None
        )
    return out


def _labels(folders: list[Path]) -> list[str]:
    """Each run's folder name; its parent's too where two share a name, and its whole
    path where two share both."""
    names = [Path(f).resolve().name for f in folders]
    taken = Counter(names)
    labels = [
        name if taken[name] == 1 else f"{Path(f).resolve().parent.name}/{name}"
        for name, f in zip(names, folders, strict=True)
    ]
    taken = Counter(labels)
    return [
        label if taken[label] == 1 else str(Path(f).resolve())
        for label, f in zip(labels, folders, strict=True)
    ]


def comparison_table(document: dict[str, Any], width: int = 80) -> Table:
    """The runs side by side, for a terminal ``width`` columns wide."""
    runs = document["runs"]
    table = Table(title="runs side by side", show_lines=False)
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, cells: list[str]) -> None:
        rows.append((label, cells))

    row("scenario", [str(r["name"]) for r in runs])
    row("framework, ranks", [f"{r['framework']}, {r['world_size']}" for r in runs])
    # A run resumed near its end measured a few steps: its figures are few steps'.
    row("steps measured", [_steps(r) for r in runs])
    row("samples/s", [f"{r['samples_per_s']:.1f}" for r in runs])
    row("vs the first", [f"{r['vs_first']:.2f}x" if r["vs_first"] else "-" for r in runs])
    row("step ms (p50)", [f"{r['step_ms_p50']:.1f}" for r in runs])
    for phase in document["phases"]:
        row(f"  {phase} ms", [_ms(r["phases_ms"][phase]) for r in runs])
    for key, label in POP.items():
        row(label, [_fraction(r["pop"][key]) for r in runs])
    names = list(dict.fromkeys(n for r in runs for n in r["optimizations"]))
    for name in names:
        figures = list(dict.fromkeys(f for r in runs for f in r["optimizations"].get(name, {})))
        for figure in figures:
            cells = []
            for r in runs:
                section = r["optimizations"].get(name)
                cells.append("off" if section is None else _value(section.get(figure)))
            row(f"{name}: {figure}", cells)
    # The row names stay whole where the figures fit beside them, and the long run
    # names fold; else rich narrows every column alike ("communicat / ion efficiency").
    names_width = max(len(label) for label, _ in rows) + 3
    figures_width = sum(max(len(cells[i]) for _, cells in rows) + 3 for i in range(len(runs)))
    table.add_column("", overflow="fold", no_wrap=names_width + figures_width + 1 <= width)
    for run in runs:
        table.add_column(run["label"], justify="right", overflow="fold")
    for label, cells in rows:
        table.add_row(label, *cells)
    sampled = [r["label"] for r in runs if r["phases_profiled_steps"]]
    if sampled:
        table.caption = (
            "phases split from a sampled profile (see each summary's phases_source): "
            + ", ".join(sampled)
        )
    return table


def _resumed_from(summary: dict[str, Any]) -> int | None:
    section = (summary.get("optimizations") or {}).get("checkpoint")
    return section.get("resumed_from_step") if isinstance(section, dict) else None


def _steps(run: dict[str, Any]) -> str:
    steps = "?" if run["steps"] is None else str(run["steps"])
    resumed = run["resumed_from_step"]
    return steps if resumed is None else f"{steps} (resumed at {resumed})"


def _times_1000(value: float | None) -> float | None:
    return None if value is None else value * 1e3


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def phases_plot(document: dict[str, Any], path: Path) -> Path:
    runs, phases = document["runs"], document["phases"]
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(runs), 4.2))
    # At positions, not by label: bars of one label (a run named twice) were drawn as one.
    labels, places = [r["label"] for r in runs], list(range(len(runs)))
    bottom = [0.0] * len(runs)
    colors = plt.get_cmap("tab10")
    for i, phase in enumerate(phases):
        values = [r["phases_ms"][phase] or 0.0 for r in runs]
        if not any(values):
            continue
        ax.bar(places, values, bottom=bottom, label=phase, color=colors(i % 10))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, (total, run) in enumerate(zip(bottom, runs, strict=True)):
        ax.text(x, total, f"{run['samples_per_s']:.0f}/s", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("ms per step (mean over ranks)")
    ax.set_title("where each step's time went (label: samples/s)", fontsize=9)
    handles, names = ax.get_legend_handles_labels()  # top of the stack first
    ax.legend(handles[::-1], names[::-1], fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
    ax.set_ylim(0, max(bottom) * 1.12 if max(bottom) > 0 else 1)
    ax.set_xticks(places, labels)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right", fontsize=8)
    return save_figure(fig, path)


def write_comparison(document: dict[str, Any], folder: Path | None) -> dict[str, Path]:
    if folder is None:
        folder = new_stamped(Path("runs"), "compare")
    folder.mkdir(parents=True, exist_ok=True)
    files = {"json": folder / "compare.json", "plot": folder / "phases.png"}
    files["json"].write_text(json.dumps(document, indent=2) + "\n")
    phases_plot(document, files["plot"])
    return files


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
