"""The report's PNG plots: an overview of the comparison rows, the contention
curves, the study's history, knob importances and (with two objectives) the
Pareto front.

Every measured point is drawn at its median with its repeats' range as an error
bar. Each contention curve is drawn relative to its own lowest level (off, or
intensity 0), so a curve of small numbers (goodput without checkpoints) reads as
well as one of large numbers. Levels sit in a fixed order (off, then numbers
ascending, then other choices as declared), and a line joins only numeric
levels: off and categorical choices are points of their own.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from .analysis import Analysis  # noqa: E402

STYLES = {
    "alone": ("alone (the others off)", "tab:blue", "o", -0.08),
    "with_others": ("with the others at the tuned best", "tab:orange", "s", 0.08),
}


def write_plots(analysis: Analysis, document: dict[str, Any], folder: Path) -> dict[str, Path]:
    files = {}
    rows = [r for r in document["comparison"] if r["measured"]]
    if rows:
        figure = overview(rows, document.get("checkpoint"))
        files["overview_plot"] = save_figure(figure, folder / "overview.png")
    if document["curves"]:
        files["contention_plot"] = save_figure(
            contention(document["curves"], analysis.metric), folder / "contention.png"
        )
    if document.get("drift"):
        files["drift_plot"] = save_figure(drift(document["drift"]), folder / "drift.png")
    if analysis.measured:
        files["history_plot"] = save_figure(history(analysis), folder / "history.png")
    if document["importances"]:
        files["importance_plot"] = save_figure(
            importances(document["importances"]), folder / "importances.png"
        )
    if analysis.pareto():
        files["pareto_plot"] = save_figure(pareto(analysis), folder / "pareto.png")
    return files


def overview(rows: list[dict[str, Any]], checkpoints: dict[str, Any] | None = None) -> Any:
    """Left: each row's throughput relative to the baseline, with its interval (paired
    where the rows raced side by side); "~" where the noise cannot tell it from 1.
    Right: the rows' goodput (samples/s), and with the checkpoint model the goodput the
    baseline would keep without checkpoints (hatched)."""
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(10, 0.8 + 0.5 * len(rows)), sharey=True, width_ratios=(3, 2)
    )
    rows = rows[::-1]
    labels = [r["row"] for r in rows]
    ratios = [r["throughput_vs_baseline"] or (None, None, None) for r in rows]
    values = [ratio if ratio is not None else 0.0 for ratio, _, _ in ratios]
    errors = [
        [
            v - (low if low is not None else v)
            for v, (_, low, _) in zip(values, ratios, strict=True)
        ],
        [
            (high if high is not None else v) - v
            for v, (_, _, high) in zip(values, ratios, strict=True)
        ],
    ]
    bars = left.barh(labels, values, xerr=errors, capsize=3, color="tab:blue", alpha=0.75)
    left.axvline(1.0, color="grey", linewidth=0.8)
    for bar, row, value, (_, low, high) in zip(bars, rows, values, ratios, strict=True):
        if row["disagree"]:
            bar.set_hatch("//")
            bar.set_alpha(0.4)
        text = f"{value:.2f}x" if value else ""
        within = low is not None and low <= 1.0 <= high  # its own interval holds 1
        if text and within and not row["row"].startswith("baseline"):
            text = "~" + text
        left.text(
            high if high is not None else value,
            bar.get_y() + bar.get_height() / 2,
            f"  {text} (n={row['measured']})",
            va="center",
            fontsize=8,
        )
    top = max((h for _, _, h in ratios if h is not None), default=1.0)
    left.set_xlim(0, top * 1.35)
    left.set_xlabel("throughput / baseline's: paired value, bar = 95 % interval")
    left.set_title("~: within noise of the baseline; hatched: repeats disagree", fontsize=8)
    goodputs = [r["goodput"] or 0.0 for r in rows]
    right.barh(labels, goodputs, color="tab:green", alpha=0.75)
    if checkpoints is not None:
        alone = checkpoints["alone"]
        base = next((r for r in rows if r["row"].startswith("baseline")), None)
        if base is not None and base["throughput"]:
            without = base["throughput"] * alone["efficiency_without"]
            right.barh(
                ["baseline, no checkpoints"],
                [without],
                color="white",
                edgecolor="tab:green",
                hatch="//",
            )
        every = checkpoints["trials_every"]
        right.set_title(
            "without checkpoints (the model: they do not pay)"
            if every is None
            else f"checkpoints every {every} steps (the model's interval)",
            fontsize=8,
        )
    right.set_xlabel("goodput (samples/s)")
    right.set_xlim(0, max(goodputs + [1.0]) * 1.15)
    fig.tight_layout()
    return fig


def drift(section: dict[str, Any]) -> Any:
    """The control's measurements over the study (relative to their mean) with the
    line through them, and each side-by-side round's speed from the paired fit."""
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    times = [t / 60 for t, _ in section["points"]]
    values = [v for _, v in section["points"]]
    mean = sum(values) / len(values)
    ax.plot(times, [v / mean for v in values], "o", color="tab:blue", label="control (baseline)")
    slope = section["slope_per_hour"] / 60  # per minute
    center = sum(times) / len(times)
    line = [math.exp(slope * (t - center)) for t in (times[0], times[-1])]
    style = "-" if section["significant"] else ":"
    said = "beyond the noise: corrected" if section["significant"] else "within the noise"
    ax.plot([times[0], times[-1]], line, style, color="tab:blue", label=f"its line ({said})")
    if section["rounds"]:
        ax.plot(
            [r["at_s"] / 60 for r in section["rounds"]],
            [r["speed"] for r in section["rounds"]],
            "s",
            color="tab:orange",
            label="the control in each side-by-side round (paired fit)",
        )
    ax.axhline(1.0, color="grey", linewidth=0.6)
    ax.set_xlabel("minutes since the first control")
    ax.set_ylabel("speed / its mean")
    ax.set_title(
        f"the machine over the study: the control moved {section['change']:+.1%}", fontsize=9
    )
    ax.legend(fontsize=7)
    return fig


def contention(curves: dict[str, dict[str, Any]], metric: str) -> Any:
    fig, axes = plt.subplots(1, len(curves), figsize=(4.4 * len(curves), 3.6), squeeze=False)
    for ax, (name, curve) in zip(axes[0], curves.items(), strict=True):
        series = curve["points"]
        levels = ordered_levels([p["level"] for key in series for p in series[key]])
        where = {level: i for i, level in enumerate(levels)}
        for key, points in series.items():
            if not points:
                continue
            label, color, marker, shift = STYLES[key]
            points = sorted(
                (p for p in points if p.get("relative")), key=lambda p: where[p["level"]]
            )
            xs = [where[p["level"]] + shift for p in points]
            ys = [p["relative"][0] for p in points]
            low = [p["relative"][0] - p["relative"][1] for p in points]
            high = [p["relative"][2] - p["relative"][0] for p in points]
            ax.errorbar(xs, ys, yerr=[low, high], fmt=marker, color=color, capsize=3, label=label)
            numeric = [(x, y) for x, y, p in zip(xs, ys, points, strict=True) if _number(p)]
            if len(numeric) > 1:
                ax.plot([x for x, _ in numeric], [y for _, y in numeric], "-", color=color)
        ax.axhline(1.0, color="grey", linewidth=0.6)
        point = curve["contention_point"]
        if curve["flat"]:
            ax.set_title(f"{name}: within noise at every level", fontsize=9)
        elif curve.get("unmeasured_above"):
            ax.set_title(f"{name}: best at {point}, higher levels not measured", fontsize=9)
        elif curve.get("at_top"):
            ax.set_title(f"{name}: best at {point}, the top of the range searched", fontsize=9)
        else:
            ax.set_title(f"{name}: stops paying beyond {point}", fontsize=9)
            if point in where:
                ax.axvline(where[point], color="grey", linestyle=":", label="contention point")
        ax.set_xticks(range(len(levels)), [str(level) for level in levels])
        ax.set_xlabel(curve["level"])
    axes[0][0].set_ylabel(f"{metric} / at the curve's lowest level")
    fig.suptitle(
        "contention curves: each level / the curve's lowest, with its 95 % interval "
        "(paired where measured side by side)",
        fontsize=9,
    )
    fig.tight_layout()
    legend_below(fig, axes[0])
    return fig


def ordered_levels(levels: list[Any]) -> list[Any]:
    """off first, then numbers ascending, then other choices in the order given."""
    unique = list(dict.fromkeys(levels))
    numbers = sorted(v for v in unique if _is_number(v))
    others = [v for v in unique if not _is_number(v) and v != "off"]
    return (["off"] if "off" in unique else []) + numbers + others


def history(analysis: Analysis) -> Any:
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ordered = sorted(analysis.measured, key=lambda m: m.number)
    values = [m.value(analysis.metric) for m in ordered]
    ax.plot([m.number for m in ordered], values, "o", label="trial", alpha=0.6)
    best_so_far = [max(values[: i + 1]) for i in range(len(values))]
    # One lucky measurement, not the report's best (a median of repeats): said so.
    ax.plot([m.number for m in ordered], best_so_far, "-", label="highest single trial so far")
    ax.set_xlabel("trial")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"{analysis.metric} (samples/s)")
    ax.legend(fontsize=7)
    return fig


def importances(values: dict[str, float]) -> Any:
    fig, ax = plt.subplots(figsize=(6, 0.5 + 0.4 * len(values)))
    names = list(values)[::-1]
    ax.barh(names, [values[n] for n in names])
    ax.set_xlabel("importance (share of the total: the knobs' bars sum to 1)")
    return fig


def pareto(analysis: Analysis) -> Any:
    front = analysis.pareto()
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ax.plot(
        [m.throughput for m in analysis.measured],
        [m.goodput for m in analysis.measured],
        "o",
        alpha=0.4,
        label="trials",
    )
    ax.plot(
        [m.throughput for m in front],
        [m.goodput for m in front],
        "o",
        color="red",
        label="Pareto front",
    )
    for m in front:  # which trial each choice is (its setting: report.md)
        ax.annotate(
            f"#{m.number}",
            (m.throughput, m.goodput),
            xytext=(4, 4),
            textcoords="offset points",
            fontsize=7,
        )
    ax.margins(0.12)  # room for the trial numbers inside the axes
    ax.set_xlabel("throughput (samples/s)")
    ax.set_ylabel("goodput (samples/s)")
    ax.legend(fontsize=7)
    return fig


def legend_below(fig: Any, axes: Any) -> None:
    """One legend for the figure's plots, under them, each label once: it hides no
    point (each plot's own legend covered the curves) and is not repeated."""
    entries: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    if entries:  # nothing measured: no legend (matplotlib would warn on the terminal)
        fig.legend(
            list(entries.values()),
            list(entries),
            loc="upper center",
            bbox_to_anchor=(0.5, 0.0),
            ncol=min(3, len(entries)),
            fontsize=8,
            frameon=False,
        )


def save_figure(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(point: dict[str, Any]) -> bool:
    return _is_number(point["level"])
