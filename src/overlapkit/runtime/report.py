"""The run folder's files and the summary table a person reads at the end of a run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def write_run_files(
    run_dir: Path,
    records: list[dict[str, Any]],
    summary: dict[str, Any],
    trace_events: list[dict[str, Any]] | None = None,
    resumed_at: int | None = None,
) -> None:
    """``steps.jsonl`` and ``summary.json`` (and ``trace.json``). A run resumed at step
    ``resumed_at`` keeps the earlier runs' records of the steps before it in
    ``steps.jsonl``; the summary is this run's."""
    run_dir.mkdir(parents=True, exist_ok=True)
    earlier = []
    if resumed_at is not None and (run_dir / "steps.jsonl").is_file():
        for line in (run_dir / "steps.jsonl").read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a killed run
            if isinstance(record, dict) and record.get("step", resumed_at) < resumed_at:
                earlier.append(line)
    with open(run_dir / "steps.jsonl", "w") as f:
        for line in earlier:
            f.write(line + "\n")
        for record in records:
            f.write(json.dumps(record) + "\n")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if trace_events is not None:
        (run_dir / "trace.json").write_text(json.dumps({"traceEvents": trace_events}))


LIVE_STEPS = "live-steps.jsonl"


class LiveSteps:
    """Rank 0's steps appended to ``live-steps.jsonl`` as they finish, so that a
    watcher (the tuner's pruner) can follow a run that is still going. The file is
    opened for each line (microseconds a step): a run that fails leaves no file open."""

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self._path = run_dir / LIVE_STEPS

    def write(self, record: dict[str, Any], samples_per_s: float) -> None:
        line = {
            "step": record["step"],
            "warmup": record["warmup"],
            "step_time_s": record["step_time_s"],
            "samples_per_s": samples_per_s,  # all data-parallel replicas together
        }
        with open(self._path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def close(self) -> None:
        pass  # nothing is kept open

    @staticmethod
    def read_new(path: Path, offset: int) -> tuple[str, int]:
        """For a watcher: the complete lines of ``path`` from byte ``offset`` on (a
        half-written last line waits for the next read) and the offset after them."""
        if not path.exists():
            return "", offset
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        return complete.decode(), offset + len(complete)


def summary_tables(summary: dict[str, Any]) -> list[Table]:
    """Readable tables: throughput and efficiency, where the step time went, extras."""
    from .metrics import PHASES, POP_KEYS  # torch: not for the Ray actor that reads the live steps

    step = summary["step_time_s"]
    pop = summary["pop"]
    overview = Table(title=f"{summary.get('name', 'run')}: {summary['steps']} measured steps")
    overview.add_column("metric")
    overview.add_column("value", justify="right")
    overview.add_row("ranks", str(summary["world_size"]))
    if summary["samples_per_s"] is None:  # every step warm-up (resumed at the last)
        overview.add_row("throughput", "not measured: no step after the warm-up")
    else:
        overview.add_row("throughput", f"{summary['samples_per_s']:.1f} samples/s")
        overview.add_row(
            "step time mean / p50 / p90",
            f"{step['mean'] * 1e3:.1f} / {step['p50'] * 1e3:.1f} / {step['p90'] * 1e3:.1f} ms",
        )
    for key in POP_KEYS:
        overview.add_row(key.replace("_", " "), _or_not_measured(pop[key], "{:.3f}"))
    if summary.get("final_loss") is not None:
        overview.add_row("final loss", f"{summary['final_loss']:.4f}")
    for result in summary.get("eval", {}).get("runs", [])[-1:]:
        overview.add_row(
            f"eval at step {result['step']}",
            f"accuracy {result['accuracy']:.3f} on {result['samples']} samples "
            f"in {result['time_s']:.2f} s",
        )

    # Short enough not to wrap over the narrow table (it broke after "(mean").
    phases = Table(title="where each step's time went", caption="mean over all ranks")
    phases.add_column("phase")
    phases.add_column("ms per step", justify="right")
    phases.add_column("share", justify="right")
    measured = {p: s for p, s in summary["phases_s"].items() if s is not None}
    # TensorFlow's compiled step, where no profile split it into its phases.
    unsplit = summary.get("compiled_step_s") if len(measured) < len(PHASES) else None
    total = sum(measured.values()) + (unsplit or 0.0) or 1.0
    for phase in PHASES:
        seconds = summary["phases_s"][phase]
        if seconds is None:
            phases.add_row(phase, "not measured", "")
        else:
            phases.add_row(phase, f"{seconds * 1e3:.2f}", f"{seconds / total:6.1%}")
    if unsplit is not None:
        phases.add_row(
            "compiled step, not split", f"{unsplit * 1e3:.2f}", f"{unsplit / total:6.1%}"
        )

    tables = [overview, phases]
    if summary.get("optimizations"):
        opts = Table(title="optimizations")
        opts.add_column("optimization")
        opts.add_column("settings")
        for name, section in summary["optimizations"].items():
            flat = {k: v for k, v in section.items() if not isinstance(v, (dict, list))}
            opts.add_row(name, ", ".join(f"{k}={_setting(k, v)}" for k, v in flat.items()))
            for note in section.get("notes", []):
                opts.add_row("", f"note: {note}")
        tables.append(opts)
        # An optimization may add tables of its own: {"title", "columns", "rows"}.
        for section in summary["optimizations"].values():
            for spec in section.get("tables", []):
                table = Table(title=spec["title"])
                for i, column in enumerate(spec["columns"]):
                    table.add_column(column, justify="left" if i == 0 else "right")
                for row in spec["rows"]:
                    table.add_row(*map(str, row))
                tables.append(table)
    return tables


def _setting(key: str, value: Any) -> str:
    """A setting or figure as a person reads it: 0.0182, not 0.018160840000443084;
    42.0 MiB, not 44040192 (bytes)."""
    if "bytes" in key and isinstance(value, int) and not isinstance(value, bool):
        return f"{value / 2**20:.1f} MiB" if value >= 2**20 else f"{value} B"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _or_not_measured(value: float | None, form: str) -> str:
    return "not measured" if value is None else form.format(value)


def print_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    for table in summary_tables(summary):
        console.print(table)
