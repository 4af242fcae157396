"""The report of a study: ``report.md`` and ``report.html`` for people,
``report.json`` for machines, ``best.yaml`` (the best setting as a runnable
scenario) and PNG plots (contention curves, history, importances, Pareto front)."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import yaml
from optuna.trial import TrialState
from rich.console import Console
from rich.table import Table

from .analysis import DISAGREE, NOISE_METHOD, QUEUED_AGAIN, Analysis, Z, stops_paying
from .plots import write_plots
from .sections import (
    checkpoint_section,
    checkpoint_text,
    drift_section,
    drift_text,
    race_section,
)
from .sections import race_text as _race_text
from .space import apply_params, short_setting
from .trial import with_checkpoints


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
        checkpoints = document["checkpoint"]
        if checkpoints is not None:  # the model's interval, with the pick's own cost if probed
            best = with_checkpoints(best, checkpoints["every"])
        best["name"] = f"{base['name']}-tuned"
        best.pop("tune", None)
        files["best"] = folder / "best.yaml"
        header = (
            f"# The best setting of study {analysis.study.study_name} (trial "
            f"{analysis.best.number}; median of "
            f"{len(analysis.measurements(analysis.best.params))}: "
            f"{analysis.spread(analysis.best.params, 'throughput').median:.1f} samples/s, "
            f"goodput {analysis.spread(analysis.best.params, 'goodput').median:.1f}).\n"
            f"# Run it: {_run_command(files['best'], best)}\n"
        )
        files["best"].write_text(header + yaml.safe_dump(best, sort_keys=False))
    files.update(write_plots(analysis, document, folder))
    markdown = _markdown(analysis, document, files)
    files["markdown"] = folder / "report.md"
    files["markdown"].write_text(markdown)
    files["html"] = folder / "report.html"
    files["html"].write_text(_html(markdown, analysis.study.study_name))
    return files


def report_document(analysis: Analysis) -> dict[str, Any]:
    best = analysis.best
    best_spread = None if best is None else analysis.spread(best.params)
    comparison = analysis.comparison()
    return {
        "study": analysis.study.study_name,
        "metric": analysis.metric,
        "objectives": analysis.objectives,
        "trials": {
            "complete": len(analysis.measured),
            "pruned": analysis.pruned,
            "failed": len(analysis.failed),
            # of them: stopped (Ctrl-C, tune's --timeout, no room), their settings queued
            "queued_again": sum(1 for f in analysis.failed if f["failure"] in QUEUED_AGAIN),
            "search": sum(1 for m in analysis.measured if m.role == "search"),
        },
        "best": None
        if best is None
        else {
            "trial": best.number,
            "params": best.params,
            "throughput": analysis.spread(best.params, "throughput").median,
            "goodput": analysis.spread(best.params, "goodput").median,
            "measured": best_spread.n,
            "low": best_spread.low,
            "high": best_spread.high,
            # Settings the noise cannot tell apart from the best.
            "ties": [
                {"trial": m.number, "params": m.params, "value": analysis.value(m.params)}
                for m in analysis.ties(best)
            ],
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
        "noise_method": NOISE_METHOD,
        "noise_settings": analysis.noise_settings,
        "claim_rule": (
            f"a difference is claimed beyond {Z:g} standard errors of the difference of "
            f"the log-medians; a setting whose own spread exceeds {DISAGREE:g}x the noise "
            "is flagged and judged by its own spread"
        ),
        "paired_noise": analysis.paired_noise,
        "warnings": _warnings(analysis, comparison),
        "race": race_section(analysis),
        "drift": drift_section(analysis),
        "checkpoint": checkpoint_section(analysis),
        "comparison": comparison,
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


def _warnings(analysis: Analysis, comparison: list[dict[str, Any]]) -> list[str]:
    out = []
    unfinished = analysis.study.get_trials(
        deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING)
    )
    if unfinished:
        out.append(
            f"the study is unfinished: {len(unfinished)} trial(s) running or queued (a tune "
            "still going, or one that was stopped: run tune again to finish it); what "
            "follows is of the trials done so far"
        )
    if analysis.repeats < 3 and analysis.race is None:  # (a race is judged by its paired fit)
        if analysis.repeats >= 2:
            said = "the median of 2 is their mean, and one slow run moves it by half"
        elif analysis.noise is None:
            said = "nothing was measured again, so nothing is confirmed and the noise is unknown"
        else:  # the search happened to run a setting twice: a noise from that alone
            said = (
                "no setting was measured again on purpose, so nothing is confirmed, and the "
                "noise comes only from the settings the search happened to run twice"
            )
        out.append(
            f"tune.repeats is {analysis.repeats}: {said}; use 3 or more for figures you act on"
        )
    if analysis.noise is None:
        out.append(
            "no setting was measured twice: the noise is unknown, and differences under "
            "2 % are read as equal without knowing whether that is enough"
        )
    unpriced = sorted(
        m.number
        for m in analysis.measured
        if m.attrs.get("checkpoints") == 0 and not m.attrs.get("checkpoint_model")
    )
    if unpriced and analysis.metric == "goodput":
        tune = analysis.tune
        out.append(
            f"trial{'s' if len(unpriced) > 1 else ''} {', '.join(map(str, unpriced))} "
            f"took no checkpoint in their {tune.trial_steps} steps (their "
            "interval is longer): their goodput counts the checkpoints as free; make "
            "tune.steps longer than the checkpoint intervals searched"
        )
    disagree = [r["row"] for r in comparison if r["disagree"]]
    if disagree:
        out.append(
            "repeats disagree by more than the noise in: "
            + ", ".join(disagree)
            + " (their medians are judged by their own spread)"
        )
    return out


def comparison_table(document: dict[str, Any]) -> Table:
    """The comparison for a terminal: fits 80 columns without cutting a name (knobs
    abbreviated as `short_setting` does; the files keep them whole)."""
    metric = document["metric"]
    table = Table(title=f"study {document['study']}: where overlap pays ({metric})")
    columns = ("setting", f"{metric} median", "vs base", "range", "n", "knobs")
    for column in columns:
        table.add_column(
            column,
            justify="left" if column in ("setting", "knobs") else "right",
            overflow="fold",
        )
    for row in document["comparison"]:
        table.add_row(
            row["row"] + (" (!)" if row["disagree"] else ""),
            _num(row[metric]),
            _ratio_text(row, short=True),
            _range(row),
            str(row["measured"] or ""),
            short_setting(row["params"]) if row["params"] else "",
        )
    table.caption = _noise_text(document, short=True)
    return table


def _ratio_text(row: dict[str, Any], short: bool = False) -> str:
    """The ratio to the baseline; "~" (short) or "(within noise)" when the noise
    cannot tell it from 1."""
    if row["vs_baseline"] is None:
        return ""
    if row["row"].startswith("baseline"):
        return "1.00x"
    text = f"{row['vs_baseline']:.2f}x"
    if row["beyond_noise"]:
        return text
    return f"~{text}" if short else f"{text} (within noise)"


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
    return f"{row['low']:.1f}-{row['high']:.1f}"


def _noise_text(document: dict[str, Any], short: bool = False) -> str:
    paired = document.get("paired_noise")
    side = (
        ""
        if paired is None
        else f"; side by side, one run varies by +-{paired:.1%} once the rounds' drift is out"
    )
    if document["noise"] is None:
        return "rows are medians; noise unknown (no setting was measured twice)" + side
    if short:
        return (
            f"values: paired fits of the side-by-side rounds, else medians; (!) repeats "
            f"disagree; ~ within noise (across the study one run varies by "
            f"+-{document['noise']:.1%}, 1 sigma{side}: see report.md)"
        )
    return (
        "rows measured side by side in rounds are valued by the rounds' paired fit (a "
        "slow round moves every setting in it alike), others by their median; (!) = its "
        f"repeats disagree. Noise across the study: one measurement varies by about "
        f"+-{document['noise']:.1%} (1 sigma; {document['noise_method']}, "
        f"{document['noise_settings']} settings){side}; {document['claim_rule']}; side by "
        "side, a difference is claimed beyond Student's t (97.5 %) standard errors of the "
        "paired log-ratio"
    )


def _best_text(document: dict[str, Any]) -> str:
    best = document["best"]
    if best is None:
        return "no trial finished"
    if document.get("race") is not None:
        return _race_text(document["race"]) or ""
    text = f"best: trial {best['trial']}, median of {best['measured']}"
    if not best["ties"] and document["noise"] is None:  # read by the 2 % rule
        return text + ", ahead of every other setting by over 2 % (the noise is unknown)"
    if not best["ties"]:
        return text + ", ahead of every other setting beyond the noise"
    others = "; ".join(short_setting(t["params"]) for t in best["ties"][:4])
    more = len(best["ties"]) - 4
    return (
        text
        + f"; within noise of it ({len(best['ties'])} setting(s) cannot be told apart): "
        + others
        + (f"; and {more} more" if more > 0 else "")
    )


def _curve_text(name: str, curve: dict[str, Any]) -> str | None:
    point = curve["contention_point"]
    if point is None:
        return None
    if curve["flat"]:
        return (
            f"{name}: no level of {curve['level']} differs from the best beyond the noise, "
            "so where more overlap stops paying cannot be told"
        )
    if curve.get("unmeasured_above"):
        higher = ", ".join(map(str, curve["unmeasured_above"]))
        return (
            f"{name}: best at {curve['level']}={point}, the highest level measured "
            f"({higher} not measured), so where more overlap stops paying cannot be told"
        )
    if curve.get("at_top"):
        return (
            f"{name}: best at {curve['level']}={point}, the top of the range searched, every "
            "lower level worse beyond the noise: no point where more stops paying in this "
            "range (search beyond it to find one)"
        )
    if curve["level"].endswith(".intensity"):
        text = f"{name}: more overlap stops paying beyond {curve['level']}={point}"
    else:
        text = f"{name}: as good as its best (within noise) from {curve['level']}={point}"
    peak = curve.get("peak")
    if peak is not None and peak != point:
        text += f" (its peak, at {peak}, is within the noise of {point})"
    drop = curve.get("drop_at_max")
    if drop and curve.get("drop_beyond_noise"):
        text += f" ({drop:.0%} lower at the maximum)"
    return text


def _run_command(best: Path, scenario: dict[str, Any] | None = None) -> str:
    """The command that runs the best setting: on a Ray cluster when it spans machines
    (a scenario of several machines needs one)."""
    scenario = scenario if scenario is not None else yaml.safe_load(best.read_text())
    nodes = ((scenario or {}).get("world") or {}).get("nodes", 1)
    return f"overlapkit run {best}" + (" --ray ADDRESS" if nodes and nodes > 1 else "")


def print_report(document: dict[str, Any], files: dict[str, Path], console: Console) -> None:
    console.print(comparison_table(document))
    for warning in document["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {warning}")
    console.print(_best_text(document), highlight=False)
    for line in filter(None, [drift_text(document["drift"]), *checkpoint_text(document["checkpoint"])]):
        console.print(line, highlight=False)
    texts = [_curve_text(name, curve) for name, curve in document["curves"].items()]
    if any(texts):
        center = document["center"]
        where = f" (trial {center['trial']})" if center is not None else ""
        console.print(f"each with the others at the tuned best{where}:")
    for text in filter(None, texts):
        console.print(text)
    console.print(f"report: {files['markdown']}  (also {files['html'].name}, report.json, plots)")
    if "best" in files:
        console.print(f"best setting: {_run_command(files['best'])}")


def _num(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.1f}"


# ----------------------------------------------------------------- markdown
def _markdown(analysis: Analysis, document: dict[str, Any], files: dict[str, Path]) -> str:
    trials = document["trials"]
    lines = [
        f"# Tuning report: {document['study']}",
        "",
        f"{trials['complete']} trials measured ({trials['search']} chosen by the sampler), "
        f"{trials['pruned']} pruned, {trials['failed']} failed{_queued(trials)}. "
        f"Best by **{analysis.metric}**.",
        "",
        _goodput_text(document["goodput_at"]),
        "",
        "## Comparison (all measured in this study)",
        "",
    ]
    for warning in document["warnings"]:
        lines += [f"> **Warning:** {warning}", ""]
    lines += [
        "| setting | samples/s | goodput | vs baseline | range | n | trial | knobs |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in document["comparison"]:
        trial = "" if row["trial"] is None else str(row["trial"])
        flag = " (!)" if row["disagree"] else ""
        lines.append(
            f"| {row['row']}{flag} | {_num(row['throughput'])} | {_num(row['goodput'])} | "
            f"{_ratio_text(row)} | {_range(row)} | {row['measured'] or ''} | {trial} | "
            f"{row['setting']} |"
        )
    lines += ["", _noise_text(document) + ".", "", _best_text(document) + "."]
    if "overview_plot" in files:
        lines += ["", "![baseline, each alone, naive and tuned](overview.png)"]
    if document["checkpoint"] is not None:
        lines += ["", "## How often to checkpoint (goodput)", ""]
        lines += [line for text in checkpoint_text(document["checkpoint"]) for line in (text, "")]
        lines.pop()
    if document["drift"] is not None:
        lines += ["", "## The machine's drift", "", drift_text(document["drift"]) + "."]
        if "drift_plot" in files:
            lines += ["", "![the control's measurements and the rounds' speed](drift.png)"]
    center, best = document["center"], document["best"]
    if center is not None and best and center["params"] != best["params"]:
        confirmed = best["measured"] >= max(2, document["repeats"])
        lines += [
            "",
            "The tuned best was found by the analysis phase, around the search's best "
            f"(trial {center['trial']})"
            + (
                f", and confirmed by its {best['measured']} measurements."
                if confirmed
                else f"; it was measured {best['measured']} time(s), not confirmed."
            ),
        ]
    if "best" in files:
        lines += [
            "",
            f"The best setting as a scenario: `{files['best'].name}` (`{_run_command(files['best'])}`).",
        ]
    lines += ["", "## Where more overlap stops paying (contention points)", ""]
    lines += [
        "| optimization | level | alone: stops paying at | with the others at the tuned best: stops paying at | at the maximum vs peak |",
        "|---|---|---:|---:|---:|",
    ]
    for name, curve in document["curves"].items():
        drop = curve["drop_at_max"]
        drop_text = ""
        if drop is not None:
            drop_text = f"-{drop:.0%}" if curve["drop_beyond_noise"] else "within noise"
        alone, together = stops_paying(curve, alone=True), stops_paying(curve)
        lines.append(f"| {name} | {curve['level']} | {alone} | {together} | {drop_text} |")
        points = ", ".join(
            f"{p['level']}: {p['median']:.1f}"
            + (f" ({p['low']:.1f}-{p['high']:.1f}, n={p['n']})" if p["n"] > 1 else "")
            for p in curve["points"]["with_others"]
        )
        if points:
            lines.append(f"|  | curve with the others | {points} | | |")
    lines += [
        "",
        '"within noise": no level differs from the curve\'s best beyond the noise, so '
        "the study cannot tell where more overlap stops paying.",
    ]
    if "contention_plot" in files:
        lines += ["", "![contention curves](contention.png)"]
    lines += ["", "## Pairwise interactions", ""]
    if document["interactions"]:
        lines += [
            "| A | B | gain A alone | gain B alone | gain together | interaction |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for i in document["interactions"]:
            value = f"{i['interaction']:+.0%}" + ("" if i["beyond_noise"] else " (within noise)")
            lines.append(
                f"| {i['a']} | {i['b']} | {i['gain_a']:.2f}x | {i['gain_b']:.2f}x | "
                f"{i['gain_together']:.2f}x | {value} |"
            )
        lines += [
            "",
            "A negative interaction means turning one on takes from the other's gain "
            '(they contend); "within noise": the four medians it is made of cannot '
            "tell it from none.",
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
        where = f" (trial {center['trial']})" if center is not None else ""
        lines += ["", f"## Scheduler policy at the tuned best{where}", ""]
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


def _queued(trials: dict[str, Any]) -> str:
    queued = trials["queued_again"]
    if not queued:
        return ""
    return f" ({queued} of them stopped before their end, their settings queued for the next tune)"


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
