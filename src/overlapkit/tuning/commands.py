"""The ``tune`` and ``report`` commands (called by `overlapkit.cli`)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import optuna
import yaml
from pydantic import ValidationError
from rich.console import Console

from ..launch.ray_nodes import PLUGINS
from ..runtime.cores import available
from . import TuneError
from .analysis import Analysis
from .config import TuneConfig
from .cores import describe as describe_cores
from .cores import shared, split_cores
from .gpus import split_gpus, visible_gpus
from .report import print_report, report_document, write_report
from .runner import tune
from .space import MODELLED, SpaceError, build_space, checkpoint_by_model, runnable_search
from .study import TUNE_FILE, TuneJob, default_storage, open_storage
from .trial_process import start_server


def tune_command(scenario: Any, args: argparse.Namespace, console: Console) -> int:
    from ..scenarios import dump_scenario

    scenario.data.check()
    ray = None
    if args.ray:
        from .on_ray import RayTrials

        if args.workers != 1:
            raise TuneError("--workers runs trials here; on a Ray cluster use --max-concurrent")
        ray = RayTrials(scenario.world, args.ray, args.max_concurrent)
        scenario.world = ray.world  # the device the cluster decided, for every trial
        scenario.check_setup(gpus_here=False)  # each machine checks its own GPUs
    else:
        if args.max_concurrent is not None:
            raise TuneError("--max-concurrent bounds trials on a Ray cluster: add --ray")
        if scenario.world.nodes > 1:
            raise TuneError(
                f"world.nodes: {scenario.world.nodes}: trials over several machines need --ray"
            )
        scenario.check_setup()
        if scenario.device_type != "cuda":
            start_server()  # its imports run while the study is set up
    if problem := scenario.search_problem():
        raise TuneError(problem)
    if not scenario.optimizations and scenario.tune.search is None:
        _choose_optimizations(scenario)
    if scenario.log.tensorboard is not None:  # the trials run in folders of their own
        scenario.log.tensorboard = str(Path(scenario.log.tensorboard).resolve())
    base = yaml.safe_load(dump_scenario(scenario))
    settings = scenario.tune.model_dump()
    settings["search"], left_out = runnable_search(
        scenario.tune.search,
        scenario.optimizations,
        scenario.setup,
        scenario.framework,
    )
    for note in left_out:
        Console(stderr=True).print(f"tune: {note}", highlight=False, soft_wrap=True)
    if args.trials is not None:
        settings["trials"] = args.trials
    if args.storage:
        settings["storage"] = args.storage
    if args.study:
        settings["study"] = args.study
    try:
        config = TuneConfig(**settings)
    except ValidationError as error:
        first = error.errors()[0]
        key = ".".join(map(str, first["loc"]))
        raise TuneError(f"tune.{key}: {first['msg']}, got {first.get('input')!r}") from None
    if checkpoint_by_model(base.get("optimizations") or {}, config):
        named = (config.search or {}).get(MODELLED)
        knobs = [k for k in (named or []) if k not in ("intensity", "every")]
        Console(stderr=True).print(
            "tune: the checkpoint's interval comes from the goodput model (Young/Daly, from a "
            "measured cost: tune.checkpoint_interval: model), not the search"
            + (
                f"; {', '.join(f'checkpoint.{k}' for k in knobs)} not searched either (a trial "
                "takes no checkpoint at that interval: it would measure nothing)"
                if knobs
                else ""
            ),
            highlight=False,
            soft_wrap=True,
        )
    folder = args.out or Path("runs") / f"{scenario.name}-tune"
    if folder.exists() and not folder.is_dir():
        raise TuneError(f"--out {folder}: is a file; the tune folder must be a folder")
    if (folder / "scenario.yaml").is_file() and not (folder / TUNE_FILE).exists():
        raise TuneError(
            f"--out {folder}: holds a run (scenario.yaml), not a tune: its trials and "
            "report would be mixed with that run's files; name another folder"
        )
    if config.storage:
        open_checked(config.storage, "--storage" if args.storage else "tune.storage")
    job = TuneJob(
        base,
        config,
        folder,
        config.storage or default_storage(folder),
        config.study or scenario.name,
    )
    if (folder / TUNE_FILE).is_file():
        try:
            earlier = _read_tune_file(folder)
        except TuneError as error:
            raise TuneError(f"{error}: use another --out") from None
        if (earlier.study_name, earlier.storage_url) != (job.study_name, job.storage_url):
            to_continue = (
                f"--study {earlier.study_name}"
                if earlier.study_name != job.study_name
                else f"--storage {earlier.storage_url}"
            )
            raise TuneError(
                f"{folder} holds the study {earlier.study_name!r} (in {earlier.storage_url}); "
                f"tuning {job.study_name!r} in {job.storage_url} there would write over its "
                f"trial folders and report: use another --out, or {to_continue} to continue it"
            )
    if args.workers < 1:
        raise TuneError("--workers must be at least 1")
    here = available()
    gpus, cores = None, None
    if ray is not None:
        Console(stderr=True).print(ray.describe(), soft_wrap=True, markup=False)
    else:
        cores = split_cores(args.workers, here)
        if cores is not None:
            how = (
                "sharing cores, one each in turn" if shared(cores) else "each with cores of its own"
            )
            Console(stderr=True).print(
                f"{args.workers} workers, {how} for its trials: {describe_cores(cores)}",
                highlight=False,
            )
        if args.workers * scenario.world.ranks > len(here):
            Console(stderr=True).print(
                f"note: {args.workers} workers x {scenario.world.ranks} ranks on {len(here)} "
                "cores: trials share cores, and measure lower than a run on the machine alone"
            )
    if ray is None and scenario.device_type == "cuda":
        # Before any worker starts, so that a machine with too few GPUs is told at once.
        gpus = split_gpus(args.workers, scenario.world.nprocs, visible_gpus())
    try:
        space = job.space
    except SpaceError as error:
        raise TuneError(str(error)) from None
    Console(stderr=True).print(
        f"tuning {scenario.name}: {len(space.dimensions)} parameters "
        f"({', '.join(d.name for d in space.dimensions)}), grid of {space.grid_size()}; "
        f"study {job.study_name} in {job.storage_url}"
    )
    progress = Console(stderr=True)  # trial lines: stdout keeps the table (or the JSON)
    try:
        analysis = tune(
            job,
            workers=args.workers,
            timeout_s=args.timeout,
            console=progress,
            gpus=gpus,
            ray=ray,
            cores=cores,
        )
    except KeyboardInterrupt:
        progress.print(
            f"overlapkit: tune stopped; study {job.study_name} in {folder} keeps its finished "
            "trials, and the same command continues it (a trial that was stopped runs again)",
            highlight=False,
            soft_wrap=True,
        )
        return 130
    return _write(analysis, base, folder, args.json, console)


def _choose_optimizations(scenario: Any) -> None:
    """A scenario without optimizations: search every built-in one that applies."""
    chosen, left_out = scenario.applicable_optimizations()
    if not chosen:
        reasons = "; ".join(f"{name}: {why}" for name, why in left_out.items())
        raise TuneError(f"nothing to search: no optimization applies to this scenario ({reasons})")
    scenario.optimizations = {name: None for name in chosen}
    said = Console(stderr=True)
    said.print(
        f"the scenario lists no optimizations: searching those that apply, {', '.join(chosen)}",
        highlight=False,
        soft_wrap=True,
    )
    for name, why in left_out.items():
        said.print(f"  left out {name}: {why}", highlight=False, soft_wrap=True)


def open_checked(url: str, named: str, existing: bool = False) -> optuna.storages.BaseStorage:
    """The storage ``url``, opened before anything is written: a mistake in it is a
    clear error naming ``named`` (the argument or key that gave it). ``existing``: a
    file storage must already exist (a report reads; it never makes an empty one)."""
    said = f"{named} {url}"
    if url.startswith("journal:"):
        _check_file(Path(url.removeprefix("journal:")), "journal", said, existing)
        return open_storage(url)
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise TuneError(
            f"{named} {url!r} is not a storage URL: use sqlite:///PATH, "
            "postgresql+psycopg2://USER@HOST/DB or journal:PATH"
        ) from None
    if parsed.get_backend_name() == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            raise TuneError(
                f"{named} {url}: an in-memory database lives in one connection and is "
                "gone at the end; name a file: sqlite:///PATH"
            )
        _check_file(Path(parsed.database), "database", said, existing)
    try:
        return open_storage(url)
    except Exception as error:  # the driver's own words: unreachable host, bad password...
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        hint = ""
        if parsed.drivername == "postgresql" and "import" in first.lower():
            # SQLAlchemy's default PostgreSQL driver is psycopg 3; overlapkit's extra is psycopg2.
            hint = f" (name the driver: {parsed.set(drivername='postgresql+psycopg2')!s})"
        raise TuneError(f"{named} {url}: cannot open it: {first}{hint}") from None


def _check_file(path: Path, kind: str, said: str, existing: bool) -> None:
    """A storage's file: in a folder that exists, not a folder itself, and (``existing``)
    already there."""
    if not path.parent.is_dir():
        raise TuneError(f"{said}: the folder {path.parent} does not exist")
    if path.is_dir():
        raise TuneError(f"{said}: {path} is a folder; name the {kind} file in it")
    if existing and not path.is_file():
        raise TuneError(f"{said}: there is no such {kind} file")


def report_command(args: argparse.Namespace, console: Console) -> int:
    if args.compare:
        from .compare import compare_command

        return compare_command(
            [*([args.study] if args.study else []), *args.compare], args, console
        )
    if not args.study:
        raise TuneError("name a study: a tune folder or a storage URL (or --compare A B ...)")
    study, folder = load_target(args.study, args.study_name)
    folder = args.out or folder
    if folder.exists() and not folder.is_dir():
        raise TuneError(f"--out {folder}: is a file; the report goes into a folder")
    base = study.user_attrs["scenario"]
    return _write(study_analysis(study, args), base, folder, args.json, console)


def load_target(target: str, name: str | None = None) -> tuple[optuna.Study, Path]:
    """The study a tune folder or a storage URL names ("URL#NAME" picks one of several),
    and the folder its report goes to by default."""
    if (Path(target).expanduser() / TUNE_FILE).exists():
        target = str(Path(target).expanduser())
        job = _read_tune_file(Path(target))
        # existing=True: a report never creates the study's database (an empty one
        # would be left behind by the error that follows).
        storage = open_checked(job.storage_url, f"{target}/{TUNE_FILE}", existing=True)
        study = _load_study(storage, name or job.study_name, job.storage_url, name is not None)
        folder = Path(target)
    else:
        if "://" not in target and not target.startswith("journal:"):
            raise TuneError(
                f"{target} is neither a tune folder (with {TUNE_FILE}) nor a storage URL"
            )
        url, _, named = target.partition("#")
        storage = open_checked(url, "the study's URL", existing=True)
        study = _load_study(storage, name or named, url, bool(name))
        folder = Path("runs") / f"{study.study_name}-report"
    if "scenario" not in study.user_attrs:
        raise TuneError(f"study {study.study_name} was not made by overlapkit tune")
    return study, folder


def _read_tune_file(folder: Path) -> TuneJob:
    try:
        return TuneJob.load(folder)
    except (ValueError, KeyError, TypeError) as error:
        raise TuneError(
            f"{folder / TUNE_FILE} is not a tune file overlapkit can read ({error})"
        ) from None


def _load_study(
    storage: optuna.storages.BaseStorage, name: str | None, url: str, asked: bool = True
) -> optuna.Study:
    """The study ``name`` of ``storage`` (the only one, when ``name`` is None).
    ``asked``: the user named it (``--study``), rather than a tune file."""
    names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
    name = name or (names[0] if len(names) == 1 else None)
    if name not in names:
        missing = f"--study {name}" if asked else f"the study {name!r}"
        raise TuneError(
            (f"{missing}: no such study in {url}; " if name else "")
            + "choose one with --study (or URL#NAME): "
            + (", ".join(names) or "the storage holds none")
        )
    return optuna.load_study(study_name=name, storage=storage)


def study_analysis(study: optuna.Study, args: argparse.Namespace) -> Analysis:
    """The study's analysis, goodput priced at the figures ``args`` give (if any)."""
    settings = dict(study.user_attrs["tune"])
    for figure in ("mtbf_hours", "restart_s", "job_hours"):  # goodput priced at other figures
        if getattr(args, figure, None) is not None:
            settings[figure] = getattr(args, figure)
    config = TuneConfig(**settings)
    scenario = study.user_attrs["scenario"]
    try:
        space = build_space(
            scenario.get("optimizations") or {}, config, scenario.get("framework", "torch")
        )
    except SpaceError as error:  # an optimization of a plugin that is not loaded here
        raise TuneError(
            f"study {study.study_name}: {error}: it was tuned with a plugin's optimization; "
            f"load that plugin as tune did (its module in {PLUGINS}, now "
            f"{os.environ.get(PLUGINS) or 'unset'}) to report it"
        ) from None
    return Analysis.of(study, space, config)


def _write(
    analysis: Analysis, base: dict[str, Any], folder: Path, as_json: bool, console: Console
) -> int:
    document = report_document(analysis)  # importances and lookups: compute once
    files = write_report(analysis, document, base, folder)
    if as_json:
        print(json.dumps(document, indent=2, default=str))
    else:
        print_report(document, files, console)
    return 0
