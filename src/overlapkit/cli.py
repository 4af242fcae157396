"""overlapkit run | tune | report | check | list.

Exit codes: 0 success, 1 the run failed, 2 bad input (scenario, data, usage).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from . import __version__
from .data import DataNotFoundError
from .launch.cluster import ClusterConfigError
from .launch.local import NodePlace, RankFailedError
from .launch.ray_nodes import RayClusterError
from .launch.ray_run import RayRunFailed
from .models import MODEL_NAMES
from .optimizations import registered_optimizations
from .optimizations.checkpoint import CheckpointError
from .runtime import POLICIES, CombinationError
from .runtime.gpus import GPUSetupError
from .scenarios import Scenario, ScenarioError, load_scenario
from .tuning import TuneError

DATA_NAMES = ("synthetic-images", "synthetic-tokens", "cifar10", "imagefolder", "imdb")
INTENSITY_POINTS = (0.25, 0.5, 0.75, 1.0)


def _scenario_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", type=Path, help="a scenario YAML file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a value by its dotted path, e.g. --set train.steps=20 (repeatable)",
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
    run.add_argument("--out", type=Path, help="run folder (default: runs/<name>-<time>)")
    run.add_argument("--quiet", action="store_true", help="no progress bar and no table")
    run.add_argument(
        "--fresh",
        action="store_true",
        help="start over instead of resuming from the run folder's newest checkpoint",
    )
    run.add_argument("--json", action="store_true", help="print summary.json to stdout")
    _ray_argument(run, "run its world.nodes machines on the Ray cluster at ADDRESS")
    run.add_argument(
        "--node-rank",
        type=int,
        help="this machine's place (0..world.nodes-1) when starting each machine by hand",
    )
    run.add_argument("--master", help="HOST:PORT where node 0 waits for the other machines")

    tune = commands.add_parser(
        "tune", help="search the optimizations' knobs with Optuna and report where overlap pays"
    )
    _scenario_arguments(tune)
    tune.add_argument("--trials", type=int, help="the sampler's trials (default: tune.trials)")
    tune.add_argument(
        "--storage",
        help="an Optuna storage URL shared by workers and machines "
        "(default: SQLite in the tune folder; journal:PATH for a journal file)",
    )
    tune.add_argument("--study", help="the study's name (default: the scenario's name)")
    tune.add_argument("--workers", type=int, default=1, help="local worker processes (default 1)")
    tune.add_argument("--timeout", type=float, help="stop starting trials after this many seconds")
    tune.add_argument("--out", type=Path, help="tune folder (default: runs/<name>-tune)")
    tune.add_argument("--json", action="store_true", help="print report.json to stdout")
    _ray_argument(tune, "run each trial in a placement group on the Ray cluster at ADDRESS")
    tune.add_argument(
        "--max-concurrent",
        type=int,
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
    report.add_argument("--out", type=Path, help="where to write it (default: the tune folder)")
    report.add_argument("--json", action="store_true", help="print report.json to stdout")
    for figure, meaning in (
        ("--mtbf-hours", "mean time between failures"),
        ("--restart-s", "seconds to restart after a failure"),
        ("--job-hours", "the job's length"),
    ):
        report.add_argument(
            figure, type=float, help=f"goodput at another {meaning} (default: the study's)"
        )

    check = commands.add_parser("check", help="validate a scenario without running it")
    _scenario_arguments(check)

    listing = commands.add_parser("list", help="optimizations, their knobs and intensity mapping")
    listing.add_argument("--json", action="store_true")

    cluster = commands.add_parser("cluster", help="Ray cluster configs (cluster/)")
    cluster_commands = cluster.add_subparsers(dest="cluster_command", required=True)
    cluster_check = cluster_commands.add_parser(
        "check", help="validate a cluster config offline: Ray's schema and overlapkit's rules"
    )
    cluster_check.add_argument("file", type=Path)
    return parser


def _describe_scenario(scenario: Scenario) -> Table:
    table = Table(title=f"scenario {scenario.name}: ok")
    table.add_column("section")
    table.add_column("resolved")
    table.add_row("model", json.dumps(scenario.model.model_dump(mode="json")))
    table.add_row("data", json.dumps(scenario.data.model_dump(mode="json")))
    cfg = scenario.train
    table.add_row(
        "train",
        f"{cfg.warmup_steps} warm-up + {cfg.steps} measured steps of {cfg.batch_size} per rank",
    )
    table.add_row("world", json.dumps(scenario.world.model_dump(mode="json")))
    for optimization in scenario.build_optimizations():
        table.add_row(f"optimizations.{optimization.name}", json.dumps(optimization.summary()))
    table.add_row("scheduler", json.dumps(scenario.scheduler.model_dump(mode="json")))
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
    }


def _print_catalogue(console: Console, catalogue: dict[str, Any]) -> None:
    if not catalogue["optimizations"]:
        console.print("no optimizations are installed yet")
    for entry in catalogue["optimizations"]:
        table = Table(
            title=f"{entry['name']}: {entry['doc']}  (resources: {', '.join(entry['resources'])})"
        )
        table.add_column("knob")
        table.add_column("type")
        table.add_column("range / choices")
        table.add_column("default")
        points = [p for p in ("0", *map(str, INTENSITY_POINTS)) if p in entry["intensity_mapping"]]
        for point in points:
            table.add_column(f"@{float(point):g}", justify="right")
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
            cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in values]
            table.add_row(knob["name"], knob["type"], span, str(knob["default"]), *cells)
        console.print(table)
    console.print(
        "intensity 0 turns an optimization off, unless an @0 column shows a mode of its own; "
        "knobs set explicitly override the mapping"
    )
    console.print(f"models: {', '.join(catalogue['models'])}")
    console.print(f"data: {', '.join(catalogue['data'])}")
    console.print(f"scheduler policies: {', '.join(catalogue['scheduler_policies'])}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # tables piped to a file need not wrap at 80 columns
    errors = Console(stderr=True)
    try:
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
        scenario = load_scenario(args.scenario, args.overrides)
        if args.command == "tune":
            from .tuning.commands import tune_command

            return tune_command(scenario, args, console)
        if args.command == "check":
            scenario.data.check()
            scenario.check_setup()
            console.print(_describe_scenario(scenario))
            return 0
        from .run import run_scenario  # imports torch.distributed machinery: only when running

        if args.fresh and "checkpoint" in scenario.optimizations:
            scenario.optimizations["checkpoint"] = {
                **(scenario.optimizations["checkpoint"] or {}),
                "resume": False,
            }

        if args.ray:
            from .launch.ray_run import run_on_cluster

            summary = run_on_cluster(
                scenario, args.out, args.ray, args.fresh, args.quiet, args.json
            )
        else:
            summary = run_scenario(
                scenario,
                args.out,
                progress=not args.quiet,
                print_summary=not (args.quiet or args.json),
                node=_node_place(args, scenario.world.nodes),
            )
        if summary is None:  # a machine other than node 0: its part is in its run folder
            return 0
        if args.json:
            print(json.dumps(summary, indent=2))
        return 0
    except ScenarioError as error:
        errors.print("[bold red]error in scenario[/]")
        errors.print(str(error), highlight=False, markup=False, soft_wrap=True)
        return 2
    except (
        DataNotFoundError,
        CombinationError,
        GPUSetupError,
        TuneError,
        ClusterConfigError,
        RayClusterError,
    ) as error:
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
        errors.print(f"[bold red]run failed: rank {error.rank}[/]", highlight=False)
        errors.print(error.details, highlight=False, markup=False, soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        errors.print("interrupted")
        return 130


def _node_place(args: argparse.Namespace, nodes: int) -> NodePlace | None:
    if args.node_rank is None and args.master is None:
        return None
    if args.node_rank is None or args.master is None:
        raise CombinationError("--node-rank and --master go together")
    try:
        return NodePlace(nodes, args.node_rank, args.master)
    except ValueError as error:
        raise CombinationError(str(error)) from None


if __name__ == "__main__":
    sys.exit(main())
