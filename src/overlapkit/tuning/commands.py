"""The ``tune`` and ``report`` commands (called by `overlapkit.cli`)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import optuna
import yaml
from rich.console import Console

from . import TuneError
from .analysis import Analysis
from .config import TuneConfig
from .gpus import split_gpus, visible_gpus
from .report import print_report, report_document, write_report
from .runner import tune
from .space import build_space
from .study import TUNE_FILE, TuneJob, default_storage, open_storage


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
    base = yaml.safe_load(dump_scenario(scenario))
    settings = scenario.tune.model_dump()
    if args.trials is not None:
        settings["trials"] = args.trials
    if args.storage:
        settings["storage"] = args.storage
    if args.study:
        settings["study"] = args.study
    config = TuneConfig(**settings)
    folder = args.out or Path("runs") / f"{scenario.name}-tune"
    job = TuneJob(
        base,
        config,
        folder,
        config.storage or default_storage(folder),
        config.study or scenario.name,
    )
    if args.workers < 1:
        raise TuneError("--workers must be at least 1")
    cores = os.cpu_count() or 1
    gpus = None
    if ray is not None:
        Console(stderr=True).print(ray.describe(), soft_wrap=True)
    elif args.workers * scenario.world.ranks > cores:
        Console(stderr=True).print(
            f"note: {args.workers} workers x {scenario.world.ranks} ranks on {cores} cores: "
            "trials running side by side take cores from each other and measure lower"
        )
    if ray is None and scenario.device_type == "cuda":
        # Before any worker starts, so that a machine with too few GPUs is told at once.
        gpus = split_gpus(args.workers, scenario.world.nprocs, visible_gpus())
    space = job.space
    Console(stderr=True).print(
        f"tuning {scenario.name}: {len(space.dimensions)} parameters "
        f"({', '.join(d.name for d in space.dimensions)}), grid of {space.grid_size()}; "
        f"study {job.study_name} in {job.storage_url}"
    )
    progress = Console(stderr=True)  # trial lines: stdout keeps the table (or the JSON)
    analysis = tune(
        job, workers=args.workers, timeout_s=args.timeout, console=progress, gpus=gpus, ray=ray
    )
    return _write(analysis, base, folder, args.json, console)


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
    base = study.user_attrs["scenario"]
    return _write(study_analysis(study, args), base, folder, args.json, console)


def load_target(target: str, name: str | None = None) -> tuple[optuna.Study, Path]:
    """The study a tune folder or a storage URL names ("URL#NAME" picks one of several),
    and the folder its report goes to by default."""
    if (Path(target) / TUNE_FILE).exists():
        job = TuneJob.load(Path(target))
        study = optuna.load_study(
            study_name=name or job.study_name, storage=open_storage(job.storage_url)
        )
        folder = Path(target)
    else:
        if "://" not in target and not target.startswith("journal:"):
            raise TuneError(
                f"{target} is neither a tune folder (with {TUNE_FILE}) nor a storage URL"
            )
        url, _, named = target.partition("#")
        storage = open_storage(url)
        names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
        name = name or named or (names[0] if len(names) == 1 else None)
        if name not in names:
            raise TuneError(
                f"choose a study of {url} with --study (or URL#NAME): "
                f"{', '.join(names) or 'the storage holds none'}"
            )
        study = optuna.load_study(study_name=name, storage=storage)
        folder = Path("runs") / f"{name}-report"
    if "scenario" not in study.user_attrs:
        raise TuneError(f"study {study.study_name} was not made by overlapkit tune")
    return study, folder


def study_analysis(study: optuna.Study, args: argparse.Namespace) -> Analysis:
    """The study's analysis, goodput priced at the figures ``args`` give (if any)."""
    settings = dict(study.user_attrs["tune"])
    for figure in ("mtbf_hours", "restart_s", "job_hours"):  # goodput priced at other figures
        if getattr(args, figure, None) is not None:
            settings[figure] = getattr(args, figure)
    config = TuneConfig(**settings)
    space = build_space(study.user_attrs["scenario"].get("optimizations") or {}, config)
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
