"""The report of a study: ``report.md`` and ``report.html`` for people,
``report.json`` for machines, ``best.yaml`` (the best setting as a runnable
scenario) and PNG plots (contention curves, history, importances, Pareto front)."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from .analysis import Analysis  # noqa: E402
from .space import apply_params  # noqa: E402


def write_report(
    analysis: Analysis, document: dict[str, Any], base: dict[str, Any], folder: Path
) -> dict[str, Path]:
    """Write every report file into ``folder`` (``document`` is `report_document`'s
    answer for ``analysis``); return them by kind."""
    folder.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    files["json"] = folder / "report.json"
    files["json"].write_text(json.dumps(document, indent=2, default=str) + "\n")
    if analysis.best is not None:
        best = apply_params(base, analysis.space, analysis.best.params)
        best["name"] = f"{base['name']}-tuned"
        best.pop("tune", None)
        files["best"] = folder / "best.yaml"
        header = (
            f"# The best setting of study {analysis.study.study_name} (trial "
            f"{analysis.best.number}: {analysis.best.throughput:.1f} samples/s, "
            f"goodput {analysis.best.goodput:.1f}; median of "
            f"{len(analysis.measurements(analysis.best.params))}).\n"
            f"# Run it: overlapkit run {files['best']}\n"
        )
        files["best"].write_text(header + yaml.safe_dump(best, sort_keys=False))
    files.update(_plots(analysis, document, folder))
    markdown = _markdown(analysis, document, files)
    files["markdown"] = folder / "report.md"
    files["markdown"].write_text(markdown)
    files["html"] = folder / "report.html"
    files["html"].write_text(_html(markdown, analysis.study.study_name))
    return files


def report_document(analysis: Analysis) -> dict[str, Any]:
    best = analysis.best
    return {
        "study": analysis.study.study_name,
        "metric": analysis.metric,
        "objectives": analysis.objectives,
        "trials": {
            "complete": len(analysis.measured),
            "pruned": analysis.pruned,
            "failed": len(analysis.failed),
            "search": sum(1 for m in analysis.measured if m.role == "search"),
        },
        "best": None
        if best is None
        else {
            "trial": best.number,
            "params": best.params,
            "throughput": best.throughput,
            "goodput": best.goodput,
            "measured": len(analysis.measurements(best.params)),
        },
        "center": None
        if analysis.center is None
        else {"trial": analysis.center.number, "params": analysis.center.params},
        "goodput_at": {
            "mtbf_hours": analysis.tune.mtbf_hours,
            "restart_s": analysis.tune.restart_s,
            "job_hours": analysis.tune.job_hours,
        },
        "repeats": analysis.repeats,
        "noise": analysis.noise,
        "tolerance": analysis.tolerance,
        "comparison": analysis.comparison(),
        "curves": analysis.curves(),
        "interactions": analysis.interactions(),
        "importances": analysis.importances(),
        "policy": analysis.policy_effect(),
        "pareto": [
            {
                "trial": m.number,
                "params": m.params,
                "throughput": m.throughput,
                "goodput": m.goodput,
            }
            for m in analysis.pareto()
        ],
        "failures": analysis.failed,
    }


def comparison_table(document: dict[str, Any]) -> Table:
    table = Table(title=f"study {document['study']}: where overlap pays ({document['metric']})")
    columns = ("setting", "samples/s", "goodput", "vs baseline", "range", "trial", "knobs")
    for column in columns:
        table.add_column(column, justify="left" if column in ("setting", "knobs") else "right")
    for row in document["comparison"]:
        table.add_row(
            row["row"],
            _num(row["throughput"]),
            _num(row["goodput"]),
            "" if row["vs_baseline"] is None else f"{row['vs_baseline']:.2f}x",
            _range(row),
            "" if row["trial"] is None else str(row["trial"]),
            row["setting"],
        )
    if document["noise"] is not None:
        table.caption = _noise_text(document)
    return table


def _goodput_text(figures: dict[str, float]) -> str:
    return (
        f"Goodput: throughput that survives a failure every {figures['mtbf_hours']:g} h on "
        f"average in a {figures['job_hours']:g} h job, with {figures['restart_s']:g} s to restart "
        "(`overlapkit report --mtbf-hours H` prices the same trials at another MTBF)."
    )


def _range(row: dict[str, Any]) -> str:
    """The measurements' range, when the row was measured more than once."""
    if row["measured"] < 2:
        return ""
    return f"{row['low']:.1f}-{row['high']:.1f} (n={row['measured']})"


def _noise_text(document: dict[str, Any]) -> str:
    return (
        f"rows are medians; a setting measured again varies by +-{document['noise']:.0%} "
        f"(median half-range), so levels within {document['tolerance']:.0%} of a peak count as equal"
    )


def print_report(document: dict[str, Any], files: dict[str, Path], console: Console) -> None:
    console.print(comparison_table(document))
    for name, curve in document["curves"].items():
        point = curve["contention_point"]
        if point is None:
            continue
        if curve["level"].endswith(".intensity"):
            text = f"{name}: more overlap stops paying beyond {curve['level']}={point}"
        else:
            text = f"{name}: within {document['tolerance']:.0%} of its best from {curve['level']}={point}"
        console.print(text + _drop_text(curve))
    console.print(f"report: {files['markdown']}  (also {files['html'].name}, report.json, plots)")
    if "best" in files:
        console.print(f"best setting: overlapkit run {files['best']}")


def _num(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.1f}"


def _drop_text(curve: dict[str, Any]) -> str:
    drop = curve.get("drop_at_max")
    return f" ({drop:.0%} lower at the maximum)" if drop and drop > 0.005 else ""


# ------------------------------------------------------------------- plots
def _plots(analysis: Analysis, document: dict[str, Any], folder: Path) -> dict[str, Path]:
    files = {}
    curves = document["curves"]
    if curves:
        fig, axes = plt.subplots(1, len(curves), figsize=(4.2 * len(curves), 3.4), squeeze=False)
        for ax, (name, curve) in zip(axes[0], curves.items(), strict=True):
            for key, label, style in (
                ("alone", "alone", "o--"),
                ("with_others", "with the others at best", "s-"),
            ):
                points = [(str(v), y) for v, y in curve[key]]
                if points:
                    ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
            if curve["contention_point"] is not None:
                ax.axvline(
                    str(curve["contention_point"]),
                    color="grey",
                    linestyle=":",
                    label="contention point",
                )
            ax.set_title(name)
            ax.set_xlabel(curve["level"])
            ax.set_ylabel(f"{analysis.metric} (samples/s)")
            ax.legend(fontsize=7)
        files["contention_plot"] = save_figure(fig, folder / "contention.png")
    if analysis.measured:
        fig, ax = plt.subplots(figsize=(6, 3.4))
        ordered = sorted(analysis.measured, key=lambda m: m.number)
        values = [m.value(analysis.metric) for m in ordered]
        ax.plot([m.number for m in ordered], values, "o", label="trial", alpha=0.6)
        best_so_far = [max(values[: i + 1]) for i in range(len(values))]
        ax.plot([m.number for m in ordered], best_so_far, "-", label="best so far")
        ax.set_xlabel("trial")
        ax.set_ylabel(f"{analysis.metric} (samples/s)")
        ax.legend(fontsize=7)
        files["history_plot"] = save_figure(fig, folder / "history.png")
    if document["importances"]:
        fig, ax = plt.subplots(figsize=(6, 0.5 + 0.4 * len(document["importances"])))
        names = list(document["importances"])[::-1]
        ax.barh(names, [document["importances"][n] for n in names])
        ax.set_xlabel("importance")
        files["importance_plot"] = save_figure(fig, folder / "importances.png")
    pareto = analysis.pareto()
    if pareto:
        fig, ax = plt.subplots(figsize=(5, 3.6))
        ax.plot(
            [m.throughput for m in analysis.measured],
            [m.goodput for m in analysis.measured],
            "o",
            alpha=0.4,
            label="trials",
        )
        ax.plot(
            [m.throughput for m in pareto],
            [m.goodput for m in pareto],
            "o",
            color="red",
            label="Pareto front",
        )
        ax.set_xlabel("throughput (samples/s)")
        ax.set_ylabel("goodput (samples/s)")
        ax.legend(fontsize=7)
        files["pareto_plot"] = save_figure(fig, folder / "pareto.png")
    return files


def save_figure(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


# ----------------------------------------------------------------- markdown
def _markdown(analysis: Analysis, document: dict[str, Any], files: dict[str, Path]) -> str:
    trials = document["trials"]
    lines = [
        f"# Tuning report: {document['study']}",
        "",
        f"{trials['complete']} trials measured ({trials['search']} chosen by the sampler), "
        f"{trials['pruned']} pruned, {trials['failed']} failed. Best by **{analysis.metric}**.",
        "",
        _goodput_text(document["goodput_at"]),
        "",
        "## Comparison (all measured in this study)",
        "",
        "| setting | samples/s | goodput | vs baseline | range | trial | knobs |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in document["comparison"]:
        ratio = "" if row["vs_baseline"] is None else f"{row['vs_baseline']:.2f}x"
        trial = "" if row["trial"] is None else str(row["trial"])
        lines.append(
            f"| {row['row']} | {_num(row['throughput'])} | {_num(row['goodput'])} | {ratio} | {_range(row)} | {trial} | {row['setting']} |"
        )
    if document["noise"] is not None:
        lines += ["", _noise_text(document) + "."]
    center = document["center"]
    if center is not None and document["best"] and center["params"] != document["best"]["params"]:
        lines += [
            "",
            f"The tuned best was found by the analysis phase, around the search's best "
            f"(trial {center['trial']}), and confirmed by its repeats.",
        ]
    if "best" in files:
        lines += [
            "",
            f"The best setting as a scenario: `{files['best'].name}` (`overlapkit run {files['best']}`).",
        ]
    lines += ["", "## Where more overlap stops paying (contention points)", ""]
    lines += [
        "| optimization | level | alone: stops paying at | with the others at best: stops paying at | at the maximum vs peak |",
        "|---|---|---:|---:|---:|",
    ]
    for name, curve in document["curves"].items():
        drop = curve["drop_at_max"]
        lines.append(
            f"| {name} | {curve['level']} | {curve['alone_point']} | {curve['contention_point']} | "
            f"{'' if drop is None else f'-{drop:.0%}'} |"
        )
        points = ", ".join(f"{v}: {y:.1f}" for v, y in curve["with_others"])
        if points:
            lines.append(f"|  | curve with the others | {points} | | |")
    if "contention_plot" in files:
        lines += ["", "![contention curves](contention.png)"]
    lines += ["", "## Pairwise interactions", ""]
    if document["interactions"]:
        lines += [
            "| A | B | gain A alone | gain B alone | gain together | interaction |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for i in document["interactions"]:
            lines.append(
                f"| {i['a']} | {i['b']} | {i['gain_a']:.2f}x | {i['gain_b']:.2f}x | {i['gain_together']:.2f}x | {i['interaction']:+.0%} |"
            )
        lines += [
            "",
            "A negative interaction means turning one on takes from the other's gain (they contend).",
        ]
    else:
        lines.append("Not measured (needs the reference trials of two or more optimizations).")
    lines += ["", "## Knob importances", ""]
    if document["importances"]:
        lines += ["| parameter | importance |", "|---|---:|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in document["importances"].items()]
        if "importance_plot" in files:
            lines += ["", "![importances](importances.png)"]
    else:
        lines.append("Too few trials to rank the knobs.")
    if document["policy"]:
        lines += ["", "## Scheduler policy at the best setting", ""]
        lines += [f"- {k}: {v:.1f}" for k, v in document["policy"].items()]
    if document["pareto"]:
        lines += [
            "",
            "## Pareto front (throughput vs goodput)",
            "",
            "| trial | samples/s | goodput | knobs |",
            "|---:|---:|---:|---|",
        ]
        for p in document["pareto"]:
            lines.append(
                f"| {p['trial']} | {p['throughput']:.1f} | {p['goodput']:.1f} | {p['params']} |"
            )
        lines += ["", "![Pareto front](pareto.png)"]
    if "history_plot" in files:
        lines += ["", "## History", "", "![history](history.png)"]
    if document["failures"]:
        lines += [
            "",
            "## Failed trials",
            "",
            "| trial | role | failure | reason |",
            "|---:|---|---|---|",
        ]
        for f in document["failures"]:
            reason = " ".join(str(f["reason"]).split())[:200].replace("|", "/")
            lines.append(f"| {f['trial']} | {f['role']} | {f['failure']} | {reason} |")
    return "\n".join(lines) + "\n"


def _html(markdown: str, title: str) -> str:
    """A small, dependency-free rendering of the report's Markdown."""
    body, table = [], False
    for line in markdown.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if all(set(c) <= set("-:") for c in cells):
                continue
            if not table:
                body.append("<table>")
                table = True
                body.append("<tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in cells) + "</tr>")
            else:
                body.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
            continue
        if table:
            body.append("</table>")
            table = False
        if line.startswith("!["):
            alt, src = line[2:].split("](")
            body.append(f'<img alt="{html.escape(alt)}" src="{html.escape(src.rstrip(")"))}">')
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{html.escape(line.lstrip('# '))}</h{level}>")
        elif line.strip():
            body.append(f"<p>{html.escape(line)}</p>")
    if table:
        body.append("</table>")
    style = "body{font-family:sans-serif;max-width:70em;margin:2em auto}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px}"
    return f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>{style}</style></head><body>{''.join(body)}</body></html>\n"
