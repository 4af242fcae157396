"""``overlapkit report --compare A B ...``: studies side by side, typically of one
scenario on different hardware: the best setting, each optimization's contention
point and what tuning gained over the naive combination (everything at full
intensity), per study. How the point where overlap stops paying moves with the
hardware is the question the project started from."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..folders import new_stamped
from .analysis import Analysis, stops_paying
from .plots import legend_below, ordered_levels, plt, save_figure
from .space import short_setting


def compare_command(targets: list[str], args: argparse.Namespace, console: Console) -> int:
    from . import TuneError
    from .commands import load_target, study_analysis

    if len(targets) < 2:
        raise TuneError("--compare needs two studies or more")
    entries = []
    for target in targets:
        study, _ = load_target(target)
        entries.append((target, study_analysis(study, args)))
    document = compare_document(entries)
    folder = args.out or new_stamped(Path("runs"), "compare-studies")
    files = write_comparison(document, entries, folder)
    if args.json:
        print(json.dumps(document, indent=2, default=str))
    else:
        console.print(comparison_table(document))
        console.print(f"comparison: {files['markdown']}  (also compare.json, compare.png)")
    return 0


def compare_document(entries: list[tuple[str, Analysis]]) -> dict[str, Any]:
    studies = []
    for source, analysis in entries:
        rows = {row["row"]: row for row in analysis.comparison()}
        naive, tuned = rows["all on, full (naive)"], rows["tuned best"]
        base = next(row for row in rows.values() if row["row"].startswith("baseline"))
        curves = analysis.curves()
        best = analysis.best
        studies.append(
            {
                "study": analysis.study.study_name,
                "source": source,
                "hardware": hardware_of(analysis),
                "metric": analysis.metric,
                "trials": len(analysis.measured),
                "best": None
                if best is None
                else {
                    "params": best.params,
                    "value": tuned[analysis.metric],  # its median, as the report says
                    "measured": len(analysis.measurements(best.params)),
                },
                "baseline": base[analysis.metric],
                "naive": naive[analysis.metric],
                "tuned_vs_naive": _ratio(tuned[analysis.metric], naive[analysis.metric]),
                "tuned_vs_baseline": _ratio(tuned[analysis.metric], base[analysis.metric]),
                "noise": analysis.noise,
                "contention_points": {n: stops_paying(c) for n, c in curves.items()},
                "curves": {n: c["with_others"] for n, c in curves.items()},
                "levels": {n: c["level"] for n, c in curves.items()},  # each curve's knob
            }
        )
    names = sorted({n for s in studies for n in s["contention_points"]})
    taken = Counter(s["study"] for s in studies)
    for study in studies:  # one study name in several storages: tell them apart by source
        name, source = study["study"], study["source"].rstrip("/")
        study["label"] = name if taken[name] == 1 else f"{name} ({Path(source).name or source})"
    return {"studies": studies, "optimizations": names}


def hardware_of(analysis: Analysis) -> str:
    """What the study's trials ran on (most of them; all, when they differ)."""
    labels = Counter(
        m.attrs.get("hardware", "not recorded (a study from before overlapkit recorded it)")
        for m in analysis.measured
    )
    if not labels:
        return "no trial finished"
    if len(labels) == 1:
        return next(iter(labels))
    return "mixed: " + "; ".join(f"{n} trials on {label}" for label, n in labels.most_common())


def comparison_table(document: dict[str, Any]) -> Table:
    studies = document["studies"]
    table = Table(title="studies side by side", show_lines=True)
    table.add_column("")
    for study in studies:
        table.add_column(study["label"], overflow="fold")
    metric, figure = _figures(studies)

    def row(label: str, cell) -> None:
        table.add_row(label, *(cell(s) for s in studies))

    row("hardware", lambda s: s["hardware"])
    row("trials", lambda s: str(s["trials"]))
    row(f"best {metric}", lambda s: figure(s, s["best"]["value"]) if s["best"] else "-")
    row("best setting", lambda s: short_setting(s["best"]["params"]) if s["best"] else "-")
    row("naive (all at full)", lambda s: figure(s, s["naive"]))
    row("tuned vs naive", lambda s: _times(s["tuned_vs_naive"]))
    row("tuned vs baseline", lambda s: _times(s["tuned_vs_baseline"]))
    for name in document["optimizations"]:
        row(
            f"{name}: contention point",
            lambda s, n=name: _point(s["contention_points"].get(n, "absent")),
        )
    return table


def write_comparison(
    document: dict[str, Any], entries: list[tuple[str, Analysis]], folder: Path
) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    files = {"json": folder / "compare.json", "markdown": folder / "compare.md"}
    files["json"].write_text(json.dumps(document, indent=2, default=str) + "\n")
    plot = _plot(document, folder / "compare.png")
    if plot is not None:
        files["plot"] = plot
    files["markdown"].write_text(_markdown(document, plot is not None))
    return files


def _figures(studies: list[dict[str, Any]]) -> tuple[str, Callable[[dict[str, Any], Any], str]]:
    """(the metric the figures are of, how a study's figure reads): studies of different
    objectives name each figure's own (a goodput study's best read as throughput)."""
    metrics = {s["metric"] for s in studies}
    if len(metrics) == 1:
        return metrics.pop(), lambda study, value: _num(value)
    return (
        "(each study's metric)",
        lambda study, value: _num(value) + (f" {study['metric']}" if value is not None else ""),
    )


def _markdown(document: dict[str, Any], plot: bool) -> str:
    studies = document["studies"]
    metric, figure = _figures(studies)
    head = "| | " + " | ".join(s["label"] for s in studies) + " |"
    lines = [
        "# Studies side by side",
        "",
        "Contention point: the lowest intensity within the noise of the best with the "
        "other optimizations at their best; beyond it more overlap stops paying. "
        '"within noise": no intensity differs from the best beyond the noise.',
        "",
        head,
        "|" + "---|" * (len(studies) + 1),
    ]
    cells = {
        "hardware": [s["hardware"] for s in studies],
        "trials": [str(s["trials"]) for s in studies],
        f"best {metric}": [figure(s, s["best"]["value"]) if s["best"] else "-" for s in studies],
        "best setting": [_setting(s["best"]["params"]) if s["best"] else "-" for s in studies],
        "naive (all at full)": [figure(s, s["naive"]) for s in studies],
        "tuned vs naive": [_times(s["tuned_vs_naive"]) for s in studies],
        "tuned vs baseline": [_times(s["tuned_vs_baseline"]) for s in studies],
    }
    for name in document["optimizations"]:
        cells[f"{name}: contention point"] = [
            _point(s["contention_points"].get(name, "absent")) for s in studies
        ]
    for label, values in cells.items():
        lines.append(f"| {label} | " + " | ".join(v.replace("|", "/") for v in values) + " |")
    lines.append("")
    if plot:
        lines += ["![each optimization along its intensity, per study](compare.png)", ""]
    return "\n".join(lines)


def _plot(document: dict[str, Any], path: Path) -> Path | None:
    names = [
        n for n in document["optimizations"] if any(s["curves"].get(n) for s in document["studies"])
    ]
    if not names:
        return None
    metrics = {s["metric"] for s in document["studies"]}
    fig, axes = plt.subplots(1, len(names), figsize=(4.4 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        # One axis of every study's levels in order: as text, matplotlib put them in the
        # order first drawn (a second study's 0.25 after the first's 1.0).
        curves = [s["curves"].get(name) or [] for s in document["studies"]]
        levels = ordered_levels([x for curve in curves for x, _ in curve])
        where = {level: i for i, level in enumerate(levels)}
        for index, (study, curve) in enumerate(zip(document["studies"], curves, strict=True)):
            if not curve:
                continue
            peak = max(y for _, y in curve) or 1.0
            curve = sorted(curve, key=lambda point: where[point[0]])
            metric = f" ({study['metric']})" if len(metrics) > 1 else ""
            ax.plot(
                [where[x] for x, _ in curve],
                [y / peak for _, y in curve],
                "o-",
                color=f"C{index}",  # a study's colour in every plot: one legend for all
                label=f"{study['label']}{metric}: {study['hardware'].split(';')[0]}",
            )
        ax.set_xticks(range(len(levels)), [str(level) for level in levels])
        ax.set_title(name)
        knobs = {s.get("levels", {}).get(name) for s in document["studies"]} - {None}
        knob = knobs.pop().removeprefix(f"{name}.") if len(knobs) == 1 else "level"
        ax.set_xlabel(f"{knob} (the others at the tuned best)")
        ax.set_ylim(0, 1.05)
    metric = metrics.pop() if len(metrics) == 1 else "each study's metric"
    axes[0][0].set_ylabel(f"{metric}, share of the study's peak")
    fig.tight_layout()
    legend_below(fig, axes[0])
    return save_figure(fig, path)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _num(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.1f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _point(value: Any) -> str:
    return "not measured" if value is None else str(value)


def _setting(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())
