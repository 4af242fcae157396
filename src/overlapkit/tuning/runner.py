"""``overlapkit tune``: run the study's three phases with K local worker processes,
printing each trial as it finishes."""

from __future__ import annotations

import functools
import multiprocessing
import signal
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import FrozenTrial, TrialState
from rich.console import Console

from ..launch.local import resource_tracker_quiet
from . import worker_start
from .analysis import UNUSED, Analysis
from .progress import StudyPlan, StudyProgress
from .space import short_setting
from .study import (
    FINISHED,
    TuneJob,
    analysis_settings,
    confirm_settings,
    enqueue,
    fail_orphans,
    open_study,
    queued_again,
    quiet_optuna,
    reference_settings,
    repeat_settings,
    search_done,
    waiting,
    worker_main,
)

if TYPE_CHECKING:
    from .on_ray import RayTrials

POLL_S = 1.0


def tune(
    job: TuneJob,
    workers: int = 1,
    timeout_s: float | None = None,
    console: Console | None = None,
    gpus: list[list[str]] | None = None,
    ray: RayTrials | None = None,
) -> Analysis:
    """Run (or continue) the study of ``job``; return its analysis. ``gpus``: one list
    of GPU ids per worker (`gpus.split_gpus`), the only GPUs its trials see. ``ray``:
    run the trials on a Ray cluster instead (``workers`` and ``gpus`` unused)."""
    console = console or Console(stderr=True)
    quiet_optuna()
    job.folder.mkdir(parents=True, exist_ok=True)
    study = open_study(job)  # refuses a study of another scenario before tune.json changes
    job.save()
    deadline = None if timeout_s is None else time.time() + timeout_s
    pool = Pool(workers, gpus, ray)
    queue = lambda: waiting(study)  # noqa: E731
    orphans = fail_orphans(study)
    if orphans:
        console.print(f"trials {orphans} were interrupted: marked failed and queued again")
    finished = study.get_trials(deepcopy=False, states=FINISHED)
    shown = Shown({t.number for t in finished}, console)
    plan = StudyPlan.of(job.space, job.tune)
    console.print(f"study {job.study_name}: {plan.describe()}")
    rare = job.rare_checkpoints() if "goodput" in job.objectives else []
    if rare:
        console.print(
            f"[yellow]warning:[/] checkpoint intervals of {', '.join(map(str, rare))} steps "
            f"are searched, but a trial runs {job.tune.trial_steps}: those settings take no checkpoint, "
            "and their goodput counts checkpoints as free (raise tune.steps)"
        )
    # Trials stopped by Ctrl-C, a lost driver or a full cluster ran for nothing: their
    # settings were queued again, so they are not done.
    done_before = [t for t in finished if not queued_again(t)]
    if done_before:
        console.print(f"study {job.study_name}: {len(done_before)} trials already done, continuing")
    done = sum(1 for t in finished if t.user_attrs.get("role") != UNUSED)
    shown.progress = StudyProgress(plan, done, pool.at_once, console)
    try:
        _phases(job, study, queue, pool, deadline, shown)
    finally:
        shown.progress.close()
    return Analysis.of(study, job.space, job.tune)


def _phases(
    job: TuneJob,
    study: optuna.Study,
    queue: Callable[[], int],
    pool: Pool,
    deadline: float | None,
    shown: Shown,
) -> None:
    # Trials queued before this run that never ran (a run stopped in a queued phase):
    # under a heading of their own, not the next phase's (or, with no references and
    # the search done, not at all).
    _phase("queued earlier", job, study, queue, pool, deadline, shown)
    if job.tune.references:
        enqueue(study, reference_settings(job.space))
        _phase("references", job, study, queue, pool, deadline, shown)
    searched = StudyPlan.search_trials(job.space, job.tune)  # as the plan above said
    budget = lambda: searched - search_done(study)  # noqa: E731
    _phase("search", job, study, budget, pool, deadline, shown)
    if job.tune.repeats > 1:
        repeats = confirm_settings(study, Analysis.of(study, job.space, job.tune), job.tune)
        enqueue(study, repeats, again=True)
        _phase("confirm", job, study, queue, pool, deadline, shown)
    if job.tune.references:
        analysis = Analysis.of(study, job.space, job.tune)
        if analysis.center is not None:
            around = analysis_settings(job.space, analysis.center.params, analysis.alone_best())
            enqueue(study, around)
            _phase("analysis", job, study, queue, pool, deadline, shown)
            if job.tune.repeats > 1:  # the curves from medians too
                measured = Analysis.of(study, job.space, job.tune).measurements
                again = [params for _, params in around if measured(params)]
                repeats = repeat_settings(study, again, job.tune.repeats, "repeat:analysis")
                enqueue(study, repeats, again=True)
                _phase("confirm curves", job, study, queue, pool, deadline, shown)


@dataclass
class Shown:
    """The trials printed so far, and the study's progress bar."""

    numbers: set[int]
    console: Console
    progress: StudyProgress | None = None

    def new(self, study: optuna.Study) -> None:
        """Print the trials that finished since the last call, and advance the bar."""
        for trial in study.get_trials(deepcopy=False, states=FINISHED):
            if trial.number in self.numbers:
                continue
            self.numbers.add(trial.number)
            if trial.user_attrs.get("role") == UNUSED:
                continue
            self.console.print(_lines(trial, self.console.width), highlight=False)
            if self.progress is not None:
                start, end = trial.datetime_start, trial.datetime_complete
                took = (end - start).total_seconds() if start and end else None
                self.progress.finished(took)


@dataclass
class Pool:
    """Where trials run: ``workers`` local processes (their GPUs), or a Ray cluster."""

    workers: int = 1
    gpus: list[list[str]] | None = None
    ray: RayTrials | None = None

    @property
    def at_once(self) -> int:
        return self.ray.concurrency if self.ray is not None else self.workers

    def describe(self, trials: int) -> str:
        if self.ray is not None:
            return f"up to {min(self.ray.concurrency, trials)} at once on the Ray cluster"
        return f"on {min(self.workers, trials)} worker(s)"


def _phase(
    name: str,
    job: TuneJob,
    study: optuna.Study,
    todo: Callable[[], int],
    pool: Pool,
    deadline: float | None,
    shown: Shown,
) -> None:
    """Run the phase's ``todo()`` trials; again while ``todo()`` says trials are left
    and the last round lost a machine under a trial (its setting was queued again and
    it does not count), until the deadline. Not otherwise: a grid sampler ends the
    search when its grid is done, and other machines may have filled the budget."""
    first = True
    while (trials := todo()) > 0 and (deadline is None or time.time() < deadline):
        if first:
            count = f"{trials} trial{'s' if trials != 1 else ''}"
            shown.console.print(f"[bold]{name}[/]: {count} {pool.describe(trials)}")
            if shown.progress is not None:
                shown.progress.phase(name, trials)
        first = False
        lost = _queued_again_count(study)
        _round(job, study, trials, pool, deadline, shown, queued=name != "search")
        if _queued_again_count(study) == lost:
            return


def _queued_again_count(study: optuna.Study) -> int:
    return sum(1 for t in study.get_trials(deepcopy=False) if t.user_attrs.get("queued_again"))


def _round(
    job: TuneJob,
    study: optuna.Study,
    trials: int,
    pool: Pool,
    deadline: float | None,
    shown: Shown,
    queued: bool,
) -> None:
    """Up to ``trials`` trials (``queued``: every one with its setting queued)."""

    def show(study: optuna.Study, trial: FrozenTrial) -> None:
        shown.new(study)

    if pool.ray is not None:  # in this process, one thread per trial in flight
        in_flight = min(pool.ray.concurrency, trials)
        runner = functools.partial(pool.ray.run, give_up_at=deadline)
        worker_main(job, trials, deadline, [show], queued, runner=runner, in_flight=in_flight)
        return
    workers, gpus = pool.workers, pool.gpus
    if workers == 1:  # in this process: no start-up cost
        ids = gpus[0] if gpus else None
        worker_main(job, trials, deadline, callbacks=[show], queued=queued, gpus=ids)
        return
    shares = [trials // workers + (i < trials % workers) for i in range(workers)]
    context = multiprocessing.get_context("spawn")
    own = gpus or [None] * workers  # worker i's trials run on own[i] only
    processes = [
        context.Process(
            target=worker_start.start,  # Ctrl-C as it imports the tuner: no traceback
            args=(bytes(ForkingPickler.dumps((job, share, deadline, None, queued, ids))),),
            daemon=False,
        )
        for share, ids in zip(shares, own, strict=True)
        if share
    ]
    with resource_tracker_quiet():  # its tracker is the workers' (and their trials')
        for process in processes:
            process.start()
    try:
        while any(p.is_alive() for p in processes):
            time.sleep(POLL_S)
            shown.new(study)
    finally:
        for process in processes:
            process.join()
    shown.new(study)
    failed = [p.exitcode for p in processes if p.exitcode != 0]
    if failed:
        shown.console.print(f"[red]{len(failed)} worker(s) stopped with exit codes {failed}[/]")


def _worker_process(*args: Any) -> None:
    """`worker_main` in a process of its own: Ctrl-C (which reaches every process of
    the terminal) ends it quietly; the parent says how to continue."""
    stopping = []

    def on_ctrl_c(signum: int, frame: Any) -> None:
        stopping.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        worker_main(*args)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as error:
        if not stopping:
            raise
        # Optuna's bookkeeping of the trial Ctrl-C stopped failed (seen once in CI:
        # "Cannot tell a FAIL trial"): the stop is still the user's; no traceback.
        print(f"overlapkit: a worker stopped while recording its trial: {error}", file=sys.stderr)
        sys.exit(130)


def _headline(kind: str, trial: FrozenTrial) -> str:
    """What a failed trial's line says of it: the signal that killed its run (its reason
    goes on with the run's last lines), or the error it ended with (the last line)."""
    reason = str(trial.user_attrs.get("reason", "")).splitlines()
    if not reason:
        return ""
    return reason[0] if kind == "killed" else reason[-1]


def _lines(trial: FrozenTrial, width: int) -> str:
    """One line per trial: its number, result, role and setting; when that would not fit
    in ``width`` columns, the setting goes on indented lines of its own."""
    role = trial.user_attrs.get("role", "search")
    params = short_setting(trial.params)
    if trial.state == TrialState.COMPLETE:
        attrs = trial.user_attrs
        result = f"{attrs['throughput']:8.1f} samples/s  goodput {attrs['goodput']:8.1f}"
    elif trial.state == TrialState.PRUNED:
        result = "pruned".ljust(38)
    else:
        kind = trial.user_attrs.get("failure", "error")
        said = textwrap.shorten(_headline(kind, trial), 90, placeholder=" ...")
        result = f"failed ({said if said.startswith(kind) else f'{kind}: {said}'})"
    head = f"trial {trial.number:4d} {result}  {role}"
    if len(f"{head}  {params}") <= width:
        return f"{head}  {params}"
    indent = " " * 11
    return "\n".join(
        [head, textwrap.fill(params, width, initial_indent=indent, subsequent_indent=indent)]
    )
