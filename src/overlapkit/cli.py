"""overlapkit run | tune | report | compare | export | check | list | cluster.

Exit codes: 0 success, 1 the run failed, 2 bad input (scenario, data, usage).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib
import json
import os
import shlex
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table

from . import __version__
from .data import DataError, DataNotFoundError
from .earlier_run import EarlierRunError, check_earlier_run, scenario_in
from .folders import FolderInUseError, check_free, held
from .launch.cluster import ClusterConfigError
from .launch.interrupt import RunInterrupted, exit_now
from .launch.local import (
    NodePlace,
    RankFailedError,
    is_rank_zero,
    torchrun_run_dir,
    under_torchrun,
)
from .launch.ray_nodes import RayClusterError
from .launch.ray_run import RayRunFailed, RayRunRefused
from .models import MODEL_NAMES
from .optimizations import PluginError, plugin_blamed, registered_optimizations
from .optimizations.checkpoint import CheckpointError
from .runtime import POLICIES, CombinationError
from .runtime.background import stop_all
from .runtime.checkpoint_folder import listed_steps, manifest_text
from .runtime.gpus import GPUSetupError
from .scenarios import Scenario, ScenarioError, load_scenario
from .tuning import TuneError
from .warnings_line import one_line_warnings

DATA_NAMES = ("synthetic-images", "synthetic-tokens", "cifar10", "imagefolder", "imdb")
INTENSITY_POINTS = (0.25, 0.5, 0.75, 1.0)


def _at_least(low: float, kind: type = int) -> Any:
    """An argparse type: a number of ``kind`` no smaller than ``low``."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            said = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {said}") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"{text}: must be a finite number")
        if value < low:
            raise argparse.ArgumentTypeError(f"{text} is below {low:g}; at least {low:g}")
        return value

    return parse


def _above_zero(text: str) -> float:
    value = _at_least(float("-inf"), float)(text)  # a finite number
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be above 0")
    return value


def _path(text: str) -> Path:
    """An argparse type: a path, ``~`` as the home folder (no shell expands the one in
    ``--out=~/runs``: a folder named ``~`` was made here)."""
    try:
        return Path(text).expanduser()
    except RuntimeError as error:  # ~user of no such user, or no home folder
        raise argparse.ArgumentTypeError(f"{text}: {error}") from None


def _scenario_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", type=_path, help="a scenario YAML file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a value by its dotted path, e.g. --set train.steps=20 (repeatable)",
    )


def _tensorboard_argument(parser: argparse.ArgumentParser, text: str) -> None:
    parser.add_argument(
        "--tensorboard", type=_path, metavar="DIR", help=f"{text} (as --set log.tensorboard=DIR)"
    )


def _ray_argument(parser: argparse.ArgumentParser, text: str) -> None:
    parser.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        metavar="ADDRESS",
        help=f"{text} (default: auto, the cluster this machine belongs to)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="overlapkit", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"overlapkit {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="train a scenario and report where the time went")
    _scenario_arguments(run)
    run.add_argument("--out", type=_path, help="run folder (default: runs/<name>-<time>)")
    run.add_argument("--quiet", action="store_true", help="no progress bar and no table")
    run.add_argument(
        "--fresh",
        action="store_true",
        help="start over instead of resuming from the run folder's newest checkpoint",
    )
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue the newest run folder of this scenario (under runs/)",
    )
    run.add_argument("--json", action="store_true", help="print summary.json to stdout")
    _tensorboard_argument(run, "write TensorBoard event files (per-step scalars) into DIR")
    _ray_argument(run, "run its world.nodes machines on the Ray cluster at ADDRESS")
    run.add_argument(
        "--node-rank",
        type=_at_least(0),
        help="this machine's place (0..world.nodes-1) when starting each machine by hand",
    )
    run.add_argument("--master", help="HOST:PORT where node 0 waits for the other machines")

    tune = commands.add_parser(
        "tune", help="search the optimizations' knobs with Optuna and report where overlap pays"
    )
    _scenario_arguments(tune)
    tune.add_argument(
        "--trials", type=_at_least(1), help="the sampler's trials (default: tune.trials)"
    )
    tune.add_argument(
        "--storage",
        help="an Optuna storage URL shared by workers and machines "
        "(default: SQLite in the tune folder; journal:PATH for a journal file)",
    )
    tune.add_argument("--study", help="the study's name (default: the scenario's name)")
    tune.add_argument(
        "--workers",
        type=_at_least(1),
        default=1,
        help="trials at once on this machine, each worker on cores (and GPUs) of its own while there are enough (default 1)",
    )
    tune.add_argument(
        "--timeout", type=_above_zero, help="stop starting trials after this many seconds"
    )
    tune.add_argument("--out", type=_path, help="tune folder (default: runs/<name>-tune)")
    tune.add_argument("--json", action="store_true", help="print report.json to stdout")
    _tensorboard_argument(tune, "write each trial's TensorBoard run into DIR/trial-NNNNN")
    _ray_argument(tune, "run each trial in a placement group on the Ray cluster at ADDRESS")
    tune.add_argument(
        "--max-concurrent",
        type=_at_least(1),
        help="with --ray: trials in flight at most (default: as many as the cluster holds)",
    )

    report = commands.add_parser("report", help="the report of a study (written by tune too)")
    report.add_argument("study", nargs="?", help="a tune folder, or an Optuna storage URL")
    report.add_argument(
        "--compare",
        nargs="+",
        metavar="STUDY",
        help="studies (tune folders or URLs) side by side, e.g. from different hardware",
    )
    report.add_argument("--study", dest="study_name", help="the study's name in that storage")
    report.add_argument(
        "--out",
        type=_path,
        help="where to write it (default: the tune folder; with --compare, "
        "runs/compare-studies-<time>)",
    )
    report.add_argument("--json", action="store_true", help="print report.json to stdout")
    for figure, meaning in (
        ("--mtbf-hours", "the mean time between failures, in hours"),
        ("--restart-s", "the time a restart after a failure takes, in seconds"),
        ("--job-hours", "the job's length, in hours"),
    ):
        report.add_argument(
            figure,
            type=_at_least(0.0, float) if figure == "--restart-s" else _above_zero,
            help=f"price goodput with {meaning} (default: the study's)",
        )

    compare = commands.add_parser(
        "compare", help="finished runs side by side: throughput, phases, key figures"
    )
    compare.add_argument("runs", nargs="+", type=_path, metavar="RUN_DIR")
    compare.add_argument(
        "--out",
        type=_path,
        help="where compare.json and phases.png go (default: runs/compare-<time>)",
    )
    compare.add_argument("--json", action="store_true", help="print compare.json to stdout")

    export = commands.add_parser(
        "export", help="a run's trained model from its checkpoints, as one file to load"
    )
    export.add_argument(
        "run", type=_path, metavar="RUN_DIR", help="a run folder, or a checkpoint folder"
    )
    export.add_argument(
        "--step", type=_at_least(0), help="the checkpoint's step (default: the newest intact)"
    )
    export.add_argument(
        "--to", type=_path, metavar="FILE", help="where to write (default: RUN_DIR/model-step-N.pt)"
    )
    export.add_argument("--json", action="store_true", help="print what was written as JSON")

    check = commands.add_parser("check", help="validate a scenario without running it")
    _scenario_arguments(check)

    listing = commands.add_parser("list", help="optimizations, their knobs and intensity mapping")
    listing.add_argument(
        "--json",
        action="store_true",
        help="print what `list` shows as JSON (optimizations, models, data, policies)",
    )

    cluster = commands.add_parser("cluster", help="Ray cluster configs (cluster/)")
    cluster_commands = cluster.add_subparsers(dest="cluster_command", required=True)
    cluster_check = cluster_commands.add_parser(
        "check", help="validate a cluster config offline: Ray's schema and overlapkit's rules"
    )
    cluster_check.add_argument("file", type=_path)
    return parser


def _export(args: argparse.Namespace, console: Console) -> int:
    from .export import ExportError, export_model

    try:
        done = export_model(args.run, args.step, args.to)
    except (ExportError, CheckpointError) as error:
        raise UsageError(str(error)) from None
    except OSError as error:
        raise UsageError(f"{error.filename or args.to}: {error.strerror or error}") from None
    if args.json:
        print(json.dumps({**dataclasses.asdict(done), "path": str(done.path)}, indent=2))
        return 0
    for skipped in done.skipped:
        console.print(
            f"skipped the newer checkpoint at {skipped}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    console.print(
        f"wrote {done.path}: the model at step {done.step} ({done.tensors} tensors, "
        f"{done.bytes / 2**20:.1f} MiB); load it with {done.how_to_load()}",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    if done.trained_to is not None:
        console.print(
            f"note: the run trained on to step {done.trained_to}, past this checkpoint: its "
            "model after that is in no checkpoint (checkpoint.final: false, or the run "
            "stopped between checkpoints)",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    return 0


def _describe_scenario(scenario: Scenario) -> Table:
    from .scenarios.describe import describe

    table = Table(title=f"scenario {scenario.name}: ok, as it will run", show_header=False)
    table.add_column("setting", overflow="fold", style="cyan")
    table.add_column("value", overflow="fold")
    for section, rows in describe(scenario):
        table.add_row(f"[bold]{section}[/]", "", end_section=False)
        for key, value in rows:
            # escaped: rich read a value such as [intensity] as markup and showed nothing
            table.add_row(f"  {escape(key)}", escape(value))
    return table


def _catalogue() -> dict[str, Any]:
    optimizations = []
    for cls in registered_optimizations().values():
        entry = cls.describe()
        entry["intensity_mapping"] = {str(i): cls.resolve(i, {}) for i in INTENSITY_POINTS}
        if not cls.off_at_zero:
            entry["intensity_mapping"]["0"] = cls.resolve(0.0, {})
        optimizations.append(entry)
    return {
        "optimizations": optimizations,
        "models": list(MODEL_NAMES),
        "data": list(DATA_NAMES),
        "scheduler_policies": list(POLICIES),
        "policy_knobs": {
            name: [k.describe() for k in cls.knobs] for name, cls in POLICIES.items() if cls.knobs
        },
    }


def _print_catalogue(console: Console, catalogue: dict[str, Any]) -> None:
    if not catalogue["optimizations"]:
        console.print("no optimizations are installed yet")
    for entry in catalogue["optimizations"]:
        table = Table(
            title=f"{entry['name']}: {entry['doc']}  (resources: {', '.join(entry['resources'])}; "
            f"runs on {' and '.join(entry['frameworks'])})"
        )
        # The knobs, then what each intensity sets in a table of its own: as nine columns
        # at 80 columns, rich cut the knob names ("max_ov…", "bucke…").
        table.add_column("knob", no_wrap=True)
        table.add_column("type")
        table.add_column("range / choices", overflow="fold")
        table.add_column("default", overflow="fold")
        points = [p for p in ("0", *map(str, INTENSITY_POINTS)) if p in entry["intensity_mapping"]]
        mapped = []
        for knob in entry["knobs"]:
            if "choices" in knob:
                span = "|".join(map(str, knob["choices"]))
            elif "range" in knob:
                span = (
                    f"{knob['range'][0]:g}..{knob['range'][1]:g}{' log' if knob.get('log') else ''}"
                )
            else:
                span = ""
            values = [entry["intensity_mapping"][p][knob["name"]] for p in points]
            if any(v != knob["default"] for v in values):
                mapped.append((knob["name"], values))
            kind = knob["type"] + (
                f" ({', '.join(knob['frameworks'])})" if "frameworks" in knob else ""
            )
            table.add_row(knob["name"], kind, span, str(knob["default"]))
        console.print(table)
        if mapped:
            title = f"{entry['name']}: what each intensity sets"
            by_intensity = Table(title=title, min_width=len(title))  # the title on one line
            by_intensity.add_column("intensity")
            for name, _ in mapped:
                by_intensity.add_column(name, justify="right")
            for i, point in enumerate(points):
                cells = [v[i] for _, v in mapped]
                by_intensity.add_row(
                    f"@{float(point):g}",
                    *(f"{v:.3g}" if isinstance(v, float) else str(v) for v in cells),
                )
            console.print(by_intensity)
    console.print(
        "intensity 0 turns an optimization off, unless an @0 row shows a mode of its own; "
        "a knob no intensity sets keeps its default; knobs set explicitly override the mapping"
    )
    console.print(f"models: {', '.join(catalogue['models'])}")
    console.print(f"data: {', '.join(catalogue['data'])}")
    console.print(f"scheduler policies: {', '.join(catalogue['scheduler_policies'])}")
    for name, knobs in catalogue["policy_knobs"].items():
        console.print(f"  {name} (set under scheduler.{name}):")
        for knob in knobs:
            span = f" {knob['range'][0]}..{knob['range'][1]}" if "range" in knob else ""
            default = "unset" if knob["default"] is None else knob["default"]
            console.print(f"    {knob['name']} ({knob['type']}{span}, default {default}):")
            # Indented under its knob: as one line it wrapped back to column 0.
            console.print(Padding(knob["help"], (0, 0, 0, 6), expand=False))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    one_line_warnings()
    args = _parser().parse_args(argv)
    # emoji=False: a user's text ("sgd:x:") is never turned into an emoji.
    console = Console(emoji=False)
    if not console.is_terminal:
        console = Console(width=160, emoji=False)  # piped to a file: no wrap at 80 columns
    errors = Console(stderr=True, emoji=False)
    where: dict[str, Path] = {}  # the run or tune folder, once known (for an internal error)
    try:
        return _command(args, console, errors, where)
    except ScenarioError as error:
        errors.print("[bold red]error in scenario[/]")
        errors.print(str(error), highlight=False, markup=False, soft_wrap=True)
        return 2
    except USER_ERRORS as error:
        errors.print("[bold red]error:[/] ", end="")
        errors.print(str(error), highlight=False, markup=False, soft_wrap=True)
        return 2
    except CheckpointError as error:
        errors.print("[bold red]run failed:[/] ", end="")
        errors.print(str(error), highlight=False, markup=False, soft_wrap=True)
        return 1
    except RayRunFailed as error:
        errors.print("[bold red]run failed on the cluster:[/] ", end="")
        errors.print(str(error), highlight=False, markup=False, soft_wrap=True)
        return 1
    except RankFailedError as error:
        kind = _raised_class(error.raised)
        if kind is not None and issubclass(kind, (*USER_ERRORS, ScenarioError, CheckpointError)):
            # The user's mistake, found by a rank once it ran: one line, as before start.
            what = "run failed" if issubclass(kind, CheckpointError) else "error"
            errors.print(f"[bold red]{what}:[/] rank {error.rank}: ", end="", highlight=False)
            errors.print(error.raised["message"], highlight=False, markup=False, soft_wrap=True)
            return 1 if what == "run failed" else 2
        errors.print(
            _rank_failed(error, where.get("folder")),
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
        return 1
    except RunInterrupted as stop:
        if "RANK" not in os.environ:  # a run in this process: its persist ends (or is left)
            stop_all()  # before the line, which reads what the manifest lists by then
        if is_rank_zero():
            errors.print(_stopped_line(stop, args, argv, where), highlight=False, soft_wrap=True)
        if "RANK" in os.environ:  # a rank under torchrun: its process group may be mid-call
            exit_now(stop.exit_code)
        return stop.exit_code
    except KeyboardInterrupt:
        errors.print("interrupted")
        return 130
    except OSError as error:
        if not error.filename or error.errno not in PATH_ERRORS:
            errors.print(
                _internal_error(error, where.get("folder")),
                highlight=False,
                markup=False,  # an error's text may hold brackets (gloo's "[/path.cc:553]")
                soft_wrap=True,
            )
            return 1
        # A folder or file it was told to use and cannot (a file in its way, no permission).
        errors.print("[bold red]error:[/] ", end="")
        paths = " -> ".join(str(p) for p in (error.filename, error.filename2) if p)
        errors.print(
            f"{paths}: {error.strerror or error}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
        return 2
    except Exception as error:  # a bug: one line here, the traceback in a file
        errors.print(
            _internal_error(error, where.get("folder")),
            highlight=False,
            markup=False,  # an error's text may hold brackets (gloo's "[/path.cc:553]")
            soft_wrap=True,
        )
        return 1


def _raised_class(raised: dict[str, str] | None) -> type | None:
    """The class of the exception a rank raised ("module:qualname"), or None."""
    if not raised:
        return None
    module, _, name = raised["type"].partition(":")
    try:
        found: Any = importlib.import_module(module)
        for part in name.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return found if isinstance(found, type) else None


# What a path the user gave (or a folder in its way) can do: not a bug of overlapkit's.
PATH_ERRORS = {
    errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.EACCES, errno.EPERM, errno.EROFS,
    errno.ENOENT, errno.ENOSPC, errno.ENAMETOOLONG,
}  # fmt: skip


# A run folder that holds nothing and can hold nothing (what a new one holds at first).
NO_FOLDER = Path(os.devnull)
ANOTHER_DIR = "set another checkpoint.dir"  # the way out for a checkpoint folder in use


class UsageError(ValueError):
    """A command-line argument that cannot work (named in the message)."""


# The user's mistakes: named in one line, exit status 2.
USER_ERRORS = (
    PluginError,
    DataError,
    DataNotFoundError,
    CombinationError,
    GPUSetupError,
    TuneError,
    ClusterConfigError,
    RayClusterError,
    RayRunRefused,
    UsageError,
    EarlierRunError,
    FolderInUseError,
)


def _command(
    args: argparse.Namespace, console: Console, errors: Console, where: dict[str, Path]
) -> int:
    if args.command == "list":
        catalogue = _catalogue()
        if args.json:
            print(json.dumps(catalogue, indent=2))
        else:
            _print_catalogue(console, catalogue)
        return 0
    if args.command == "cluster":
        from .launch.cluster import check_cluster_file

        prepared = check_cluster_file(args.file)
        nodes = prepared.get("available_node_types") or {}
        console.print(
            f"cluster config {args.file}: ok ({prepared['provider']['type']}, "
            + ", ".join(f"{name} {node.get('resources')}" for name, node in nodes.items())
            + ")",
            highlight=False,
        )
        return 0
    if args.command == "report":
        from .tuning.commands import report_command

        return report_command(args, console)
    if args.command == "export":
        return _export(args, console)
    if args.command == "compare":
        from .compare_runs import (
            RunFolderError,
            compare_document,
            comparison_table,
            write_comparison,
        )

        try:
            document = compare_document(args.runs)
        except RunFolderError as error:
            raise UsageError(str(error)) from None
        if args.out is not None and args.out.exists() and not args.out.is_dir():
            raise UsageError(f"--out {args.out}: a file; name a folder for the comparison")
        try:
            files = write_comparison(document, args.out)
        except OSError as error:
            raise UsageError(f"--out {args.out}: {error.strerror or error}") from None
        if args.json:
            print(json.dumps(document, indent=2))
        else:
            console.print(comparison_table(document, console.width))
            console.print(f"phases: {files['plot']}  (also {files['json'].name})", highlight=False)
        return 0
    if args.command == "run" and args.ray and (args.node_rank, args.master) != (None, None):
        raise UsageError(
            "--ray places every machine itself; --node-rank and --master are for starting "
            "each machine by hand: use one way or the other"
        )
    if getattr(args, "tensorboard", None):
        args.overrides.append(f"log.tensorboard={args.tensorboard}")
    scenario = load_scenario(args.scenario, args.overrides)
    if args.command == "tune":
        from .tuning.commands import tune_command

        return tune_command(scenario, args, console)
    if args.command == "check":
        scenario.data.check()
        scenario.check_setup()
        if problem := scenario.search_problem():
            raise UsageError(problem)
        console.print(_describe_scenario(scenario))
        return 0
    return _run_command(scenario, args, errors, where)


def _run_command(
    scenario: Scenario, args: argparse.Namespace, errors: Console, where: dict[str, Path]
) -> int:
    if args.fresh and "checkpoint" in scenario.optimizations:
        scenario.optimizations["checkpoint"] = {
            **(scenario.optimizations["checkpoint"] or {}),
            "resume": False,
        }
    out = _run_folder(scenario, args)
    with _stdout_to_stderr(args.json), ExitStack() as holding:

        def on_folder(folder: Path) -> None:  # made, nothing written yet: hold it
            where.update(folder=folder)
            checkpoints = _checkpoint_folder(scenario, folder, args)
            if checkpoints is not None:
                where.update(checkpoints=checkpoints)
            if _holds_the_folder(args):
                holding.enter_context(held(folder))
                if checkpoints is not None:
                    try:
                        checkpoints.mkdir(parents=True, exist_ok=True)
                        holding.enter_context(held(checkpoints, ANOTHER_DIR))
                    except OSError:  # read-only, say: no run can checkpoint there
                        pass  # (the checkpoint optimization says what is wrong with it)

        summary = _run(scenario, args, out, on_folder)
    if summary is None or not is_rank_zero():  # another machine, or torchrun's rank > 0
        return 0
    if "run_dir" in summary:
        errors.print(f"overlapkit: results in {summary['run_dir']}", highlight=False)
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


@contextmanager
def _stdout_to_stderr(redirect: bool) -> Iterator[None]:
    """While ``redirect``, what anything writes to standard output goes to standard error:
    libraries' own lines, such as gloo's "[Gloo] Rank 0 is connected to 1 peer ranks"
    (torch 2.8 and 2.9, from C++, in this process and the ranks it starts), would otherwise
    break the JSON document that --json prints there."""
    if not redirect:
        yield
        return
    sys.stdout.flush()
    kept = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(kept, 1)
        os.close(kept)


def _run(
    scenario: Scenario,
    args: argparse.Namespace,
    out: Path | None,
    on_folder: Callable[[Path], None],
) -> dict[str, Any] | None:
    from .run import run_scenario  # imports torch.distributed: only to run

    if args.ray:
        from .launch.ray_run import run_on_cluster

        summary = run_on_cluster(
            scenario,
            out,
            args.ray,
            args.fresh,
            args.quiet,
            args.json,
            on_folder=on_folder,
        )
    else:
        node = _node_place(args, scenario.world.nodes)
        summary = run_scenario(
            scenario,
            out,
            progress=not args.quiet,
            print_summary=not (args.quiet or args.json),
            node=node,
            on_folder=on_folder,
        )
    return summary


def _run_folder(scenario: Scenario, args: argparse.Namespace) -> Path | None:
    """The run folder ``--out`` or ``--resume`` names (None: a new one), checked."""
    if args.resume:
        if args.out is not None or args.fresh:
            raise UsageError(
                f"--resume continues the newest run folder of {scenario.name}; "
                f"{'--out names one' if args.out is not None else '--fresh starts over'}: "
                "use one of them"
            )
        if "checkpoint" not in scenario.optimizations:
            raise UsageError(
                f"--resume: {scenario.name} does not checkpoint (no checkpoint in its "
                "optimizations), so there is nothing to resume"
            )
        if (scenario.optimizations["checkpoint"] or {}).get("resume") is False:
            raise UsageError(
                f"--resume: {scenario.name}'s checkpoint has resume: false (it starts over "
                "every time); drop that to resume"
            )
        earlier = [run for run in _earlier_runs(scenario.name) if _has_checkpoints(run)]
        if not earlier:
            raise UsageError(
                f"--resume: no earlier run of {scenario.name} under runs/ has checkpoints "
                "(a folder runs/NAME-* holding scenario.yaml and checkpoints/); name one "
                "with --out"
            )
        _check_free(earlier[0], scenario, args)
        check_earlier_run(earlier[0], scenario, fresh=False)
        return earlier[0]
    if args.out is not None:
        for place in (args.out, *args.out.parents):  # the nearest that exists
            if place.exists():
                if not place.is_dir():
                    what = "is a file" if place == args.out else f"{place} is a file"
                    raise UsageError(f"--out {args.out}: {what}; the run folder must be a folder")
                break
        _check_not_foreign(args.out, args.scenario)
        _check_free(args.out, scenario, args)
        check_earlier_run(args.out, scenario, fresh=args.fresh)
    elif under_torchrun():  # a folder every rank names: a rerun finds the earlier run's
        _check_free(torchrun_run_dir(scenario.name), scenario, args)
        check_earlier_run(torchrun_run_dir(scenario.name), scenario, fresh=args.fresh)
    else:  # a new folder, empty: only an absolute checkpoint.dir can hold checkpoints
        _check_free(NO_FOLDER, scenario, args)
        check_earlier_run(NO_FOLDER, scenario, fresh=args.fresh)
    if args.out is None and not args.fresh:
        earlier = [run for run in _earlier_runs(scenario.name) if _has_checkpoints(run)]
        if earlier and "checkpoint" in scenario.optimizations:
            Console(stderr=True).print(
                f"note: a new run folder; {earlier[0]} has checkpoints of this scenario: "
                "--resume continues it",
                highlight=False,
                soft_wrap=True,
            )
    return args.out


def _check_free(folder: Path, scenario: Scenario, args: argparse.Namespace) -> None:
    """Refuse at once a folder another run is training in (its launcher holds it), and
    a checkpoint folder of its own that another run is checkpointing into."""
    if _holds_the_folder(args):
        check_free(folder)
        if (shared := _checkpoint_folder(scenario, folder, args)) is not None:
            check_free(shared, ANOTHER_DIR)


def _checkpoint_folder(scenario: Scenario, folder: Path, args: argparse.Namespace) -> Path | None:
    """The checkpoint folder of a run in ``folder``, held by its own lock as the run
    folder is: another run may name it as its absolute checkpoint.dir, whether it lies
    inside this run folder or not. None without one (or checkpoint at intensity 0).
    Under --ray each machine checkpoints to its own disk: not here."""
    if args.ray:
        return None
    optimizations = scenario.build_optimizations()
    return next((o.folder_in(folder) for o in optimizations if o.name == "checkpoint"), None)


def _holds_the_folder(args: argparse.Namespace) -> bool:
    """Whether this process holds the run folder for the run: under torchrun rank 0,
    of machines started by hand node 0 (the others may share the folder)."""
    return is_rank_zero() and not args.node_rank


def _check_not_foreign(out: Path, scenario_file: Path) -> None:
    """A run writes scenario.yaml, summary.json, steps.jsonl... into its folder: never
    over the scenario file being run, nor among files that are not an earlier run's.
    (Under torchrun rank 0 decides: another machine's folder holds no scenario.yaml.)"""
    if not out.is_dir() or not is_rank_zero():
        return
    if any((out / name).exists() for name in ("checkpoints", "summary.json", "steps.jsonl")):
        return  # an earlier run's folder (its scenario.yaml is the resolved one)
    if (out / "scenario.yaml").resolve() == scenario_file.resolve():
        raise UsageError(
            f"--out {out}: the run would write its resolved scenario.yaml over "
            f"{scenario_file} itself: name another folder"
        )
    if scenario_in(out) is not None:
        return
    found = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    if found:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise UsageError(
            f"--out {out}: holds {shown}, and no earlier run (no scenario.yaml of one): a "
            "run there would mix its files with them or write over them; name a new or "
            "empty folder"
        )


def _earlier_runs(name: str, root: Path = Path("runs")) -> list[Path]:
    """Run folders of scenario ``name`` (not of ``name-wide``), newest first."""
    runs = [
        p.parent
        for p in root.glob(f"{name}-*/scenario.yaml")
        if (scenario_in(p.parent) or {}).get("name") == name
    ]
    return sorted(runs, key=lambda p: (p / "scenario.yaml").stat().st_mtime, reverse=True)


def _stopped_line(
    stop: RunInterrupted, args: argparse.Namespace, argv: list[str], where: dict[str, Path]
) -> str:
    folder = where.get("folder")
    at = f" at step {stop.step}" if stop.step is not None else ""
    line = f"overlapkit: stopped by {stop.signal_name}{at}"
    if folder is None:
        return line
    if stop.finished:  # nothing to resume: a resume would be refused
        step = f" ({stop.step})" if stop.step is not None else ""
        return (
            f"overlapkit: stopped by {stop.signal_name} after the run's last step{step}; "
            f"its results are in {folder}"
        )
    line += f"; run folder {folder}"
    newest = stop.checkpoint_step
    if "checkpoints" in where and not getattr(args, "fresh", False):
        # What the ranks' writers listed after the ranks said (a persist under way as
        # the run stopped ends first), or all there is when no rank said (one stopped hard).
        listed = _newest_listed(where["checkpoints"])
        newest = max((n for n in (newest, listed) if n is not None), default=None)
    if newest is not None:
        line += f"; the newest checkpoint is step {newest}. Resume: "
    else:
        line += "; no checkpoint was written, so the run starts over. Again: "
    kept = _without(argv, {"--out": 1, "--resume": 0, "--fresh": 0})
    prefix = "torchrun ... -m " if os.environ.get("TORCHELASTIC_RUN_ID") else ""
    return line + prefix + shlex.join(["overlapkit", *kept, "--out", str(folder)])


def _has_checkpoints(run: Path) -> bool:
    """Whether the run folder ``run`` holds checkpoints (a manifest, or step folders):
    not only an empty folder a run stopped before its first one left, with its lock."""
    folder = run / "checkpoints"
    return (folder / "manifest.json").exists() or any(folder.glob("step-*"))


def _newest_listed(checkpoints: Path) -> int | None:
    """The newest step the manifest of the folder ``checkpoints`` lists (None: none)."""
    try:
        text = manifest_text(checkpoints)
        return max(listed_steps(text), default=None) if text else None
    except (ValueError, KeyError, TypeError, OSError):  # a damaged manifest says so itself
        return None


def _without(argv: list[str], flags: dict[str, int]) -> list[str]:
    """``argv`` without ``flags`` (flag: how many values follow it)."""
    kept, skip = [], 0
    for word in argv:
        if skip:
            skip -= 1
            continue
        name = word.split("=", 1)[0]
        if name in flags:
            skip = flags[name] if "=" not in word else 0
            continue
        kept.append(word)
    return kept


def _internal_error(error: Exception, folder: Path | None) -> str:
    text = "".join(traceback.format_exception(error))
    saved = _save_traceback(text, folder)
    kind = type(error).__name__
    if _out_of_memory(kind, str(error)):
        return f"run failed: out of memory: {kind}: {error}; {saved}"
    return f"{_whose(text)}: {kind}: {error}; {saved}"


def _out_of_memory(kind: str, message: str) -> bool:
    """An error that says the machine (or GPU) had too little memory for the run's
    sizes (torch's CPU allocator, CUDA's, Python's): not a bug of overlapkit's."""
    said = message.lower()
    return kind in ("MemoryError", "OutOfMemoryError", "ResourceExhaustedError") or any(
        words in said
        for words in (
            "can't allocate memory",
            "cannot allocate memory",
            "out of memory",
            "oom when allocating",  # TensorFlow's
        )
    )


def _whose(traceback_text: str) -> str:
    """Who an unexpected error is for: a plugin whose own code raised, or overlapkit."""
    plugin = plugin_blamed(traceback_text)
    if plugin is not None:
        return f"error in the plugin {plugin}"
    return "internal error (a bug in overlapkit; please report it)"


def _rank_failed(error: RankFailedError, folder: Path | None) -> str:
    """One line for a rank of several that failed: its error, and where the
    traceback (and any other rank's) was written."""
    head, _, rest = error.details.partition("\n")
    if error.raised is None:  # no Python error: a signal, or the launcher's word
        others = "the other ranks' errors are"
        saved = f"; {_save_traceback(rest, folder, others)}" if rest else ""
        return f"run failed: rank {error.rank}: {head}{saved}"
    kind = error.raised["type"].rpartition(":")[2].rpartition(".")[2]
    whose = _whose(error.details)
    if _out_of_memory(kind, error.raised["message"]):
        whose = "out of memory"
    return (
        f"run failed: rank {error.rank}: {whose}: {kind}: "
        f"{error.raised['message']}; {_save_traceback(error.details, folder)}"
    )


def _save_traceback(text: str, folder: Path | None, what: str = "the traceback is") -> str:
    """``text`` in the run folder's error.txt (or a temporary file); says where
    ("``what`` in PATH")."""
    try:
        if folder is not None and folder.is_dir():
            path = folder / "error.txt"
        else:
            path = Path(tempfile.gettempdir()) / f"overlapkit-error-{os.getpid()}.txt"
        path.write_text(text)
        return f"{what} in {path}"
    except OSError:
        return f"{what}:\n{text}"


def _node_place(args: argparse.Namespace, nodes: int) -> NodePlace | None:
    if args.node_rank is None and args.master is None:
        return None
    if args.node_rank is None or args.master is None:
        raise UsageError("--node-rank and --master go together")
    try:
        return NodePlace(nodes, args.node_rank, args.master)
    except ValueError as error:
        raise CombinationError(str(error)) from None


if __name__ == "__main__":
    sys.exit(main())
