"""``overlapkit tune``: run the study's phases with K local workers (threads of this
process, each starting its trials' processes) or on a Ray cluster, printing each
trial as it finishes."""

from __future__ import annotations

import functools
import os
import queue
import signal
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import FrozenTrial, TrialState
from rich.console import Console

from ..launch.interrupt import stop_asked, threads_stopping
from .analysis import UNUSED, Analysis
from .phases import run_phases
from .progress import StudyPlan, StudyProgress
from .space import short_setting
from .study import (
    FINISHED,
    Runner,
    TuneJob,
    fail_orphans,
    open_study,
    queued_again,
    quiet_optuna,
    worker_main,
)
from .trial import run_trial, trials_on_cpu
from .trial_process import start_server

if TYPE_CHECKING:
    from .on_ray import RayTrials

POLL_S = 0.5  # how often the trial lines and the progress bar are brought up to date


def tune(
    job: TuneJob,
    workers: int = 1,
    timeout_s: float | None = None,
    console: Console | None = None,
    gpus: list[list[str]] | None = None,
    ray: RayTrials | None = None,
    cores: list[list[int]] | None = None,
    trial: Runner | None = None,
) -> Analysis:
    """Run (or continue) the study of ``job``; return its analysis. ``gpus``: one list
    of GPU ids per worker (`gpus.split_gpus`), the only GPUs its trials see; ``cores``:
    likewise, the cores (`cores.split_cores`). ``ray``: run the trials on a Ray
    cluster instead (``workers``, ``gpus`` and ``cores`` unused). ``trial``: what runs
    one trial on a worker (default `run_trial`; tests give a simulated machine)."""
    console = console or Console(stderr=True)
    quiet_optuna()
    job.folder.mkdir(parents=True, exist_ok=True)
    study = open_study(job)  # refuses a study of another scenario before tune.json changes
    job.save()
    deadline = None if timeout_s is None else time.time() + timeout_s
    pool = Pool(workers, gpus, ray, cores, trial)
    if trial is None and ray is None and gpus is None and trials_on_cpu(job.base):
        start_server()  # here, before the workers' threads: it changes the environment
    orphans = fail_orphans(study)
    if orphans:
        console.print(f"trials {orphans} were interrupted: marked failed and queued again")
    finished = study.get_trials(deepcopy=False, states=FINISHED)
    shown = Shown({t.number for t in finished}, console)
    plan = StudyPlan.of(job.space, job.tune, job.checkpoint_by_model)
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
        _phases(job, study, pool, deadline, shown)
    finally:
        shown.progress.close()
    return Analysis.of(study, job.space, job.tune)


def _phases(
    job: TuneJob,
    study: optuna.Study,
    pool: Pool,
    deadline: float | None,
    shown: Shown,
) -> None:
    """The study's phases (`phases.run_phases`), each phase's trials run here."""

    def run(heading: str, todo: Callable[[], int], counted: bool = True) -> bool:
        if stop_asked() or (deadline is not None and time.time() >= deadline):
            return False
        _phase(heading, job, study, todo, pool, deadline, shown, counted)
        return not stop_asked() and (deadline is None or time.time() < deadline)

    run_phases(job, study, run)


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
    """Where trials run: ``workers`` local workers (their GPUs, their cores), or a Ray
    cluster."""

    workers: int = 1
    gpus: list[list[str]] | None = None
    ray: RayTrials | None = None
    cores: list[list[int]] | None = None
    trial: Runner | None = None  # what runs one trial on a local worker (`run_trial`)

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
    counted: bool = True,
) -> None:
    """Run the phase's ``todo()`` trials; again while ``todo()`` says trials are left
    and the last round lost a machine under a trial (its setting was queued again and
    it does not count), until the deadline. Not otherwise: a grid sampler ends the
    search when its grid is done, and other machines may have filled the budget.
    ``counted``: ``name`` is a phase of the study's plan, whose count is now known
    (else one round of a phase: the plan keeps its bound)."""
    first = True
    while (trials := todo()) > 0 and (deadline is None or time.time() < deadline):
        if first:
            count = f"{trials} trial{'s' if trials != 1 else ''}"
            shown.console.print(f"[bold]{name}[/]: {count} {pool.describe(trials)}")
            if shown.progress is not None:
                shown.progress.phase(name, trials, counted)
        first = False
        copies = _copies(study)
        _round(job, study, trials, pool, deadline, shown, queued=name != "search")
        optuna.storages.fail_stale_trials(study)  # trials of machines gone: queued again
        if _copies(study) == copies:
            return


def _copies(study: optuna.Study) -> int:
    """The settings queued again (their trials stopped before their end), less those
    queued twice and dropped (each took a trial of the round)."""
    return sum(
        1
        for t in study.get_trials(deepcopy=False)
        if "again_of" in t.user_attrs and t.user_attrs.get("role") != UNUSED
    )


def _round(
    job: TuneJob,
    study: optuna.Study,
    trials: int,
    pool: Pool,
    deadline: float | None,
    shown: Shown,
    queued: bool,
) -> None:
    """Up to ``trials`` trials (``queued``: every one with its setting queued), as
    many at once as the pool holds, each from a thread of this process (a trial is
    a process of its own, here or on the cluster's machines)."""
    if pool.ray is not None:
        runner: Runner = functools.partial(pool.ray.run, give_up_at=deadline)
        in_flight = min(pool.ray.concurrency, trials)
    else:
        runner, in_flight = Workers(pool), min(pool.workers, trials)
    work = functools.partial(worker_main, job, trials, deadline, None, queued, runner, in_flight)
    _in_threads(work, lambda: shown.new(study), shown.console)


class Workers:
    """`run_trial` on a free worker's GPUs and cores (`Pool`), which its trial holds
    until it ends. Workers are threads of this process: a worker process cost each
    phase a Python, torch and Optuna to import and a forkserver of its own."""

    def __init__(self, pool: Pool) -> None:
        self.trial = pool.trial or run_trial
        self.free: queue.SimpleQueue[tuple[list[str] | None, list[int] | None]]
        self.free = queue.SimpleQueue()
        for i in range(pool.workers):
            gpus = pool.gpus[i] if pool.gpus else None
            cores = pool.cores[i] if pool.cores else None
            self.free.put((gpus, cores))

    def __call__(
        self,
        data: dict[str, Any],
        folder: Path,
        timeout_s: float,
        on_step: Callable[[int, float], bool] | None = None,
    ) -> dict[str, Any]:
        gpus, cores = self.free.get()  # one is free: no more trials run than workers
        try:
            return self.trial(data, folder, timeout_s, on_step, gpus=gpus, cores=cores)
        finally:
            self.free.put((gpus, cores))


def _in_threads(work: Callable[[], None], meanwhile: Callable[[], None], console: Console) -> None:
    """``work()`` in a thread of its own, ``meanwhile()`` called here until it ends
    (the trial lines, the progress bar). Ctrl-C reaches this thread only: it stops
    the trials (each is killed and queued again), waits for them, and is raised."""
    errors: list[BaseException] = []
    done = threading.Event()  # not Thread.join: Ctrl-C within it marks a live thread ended

    def run() -> None:
        try:
            work()
        except BaseException as error:  # noqa: BLE001  (raised here, below)
            errors.append(error)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    try:
        while not done.wait(POLL_S):
            meanwhile()
        meanwhile()
    except BaseException:  # Ctrl-C, or this thread's own error (the study unreadable)
        _wait_stopping(done, console)
        if errors and not isinstance(errors[0], KeyboardInterrupt):
            console.print(f"overlapkit: tune stopped while recording a trial: {errors[0]}")
        raise
    if errors:
        raise errors[0]


def _wait_stopping(done: threading.Event, console: Console) -> None:
    """Tell the trials' thread to stop and wait for it to end (each trial is killed,
    its setting queued again). A third Ctrl-C quits at once, leaving what still runs
    (a machine that does not answer) to the next tune."""
    pressed, said = 1, 0
    with threads_stopping():
        while not done.is_set():
            try:
                if said < pressed:  # a line for each Ctrl-C taken
                    left = 3 - pressed
                    plural = "s" if left > 1 else ""
                    console.print(
                        f"overlapkit: stopping the trials (Ctrl-C {left} more time{plural} "
                        "quits at once)"
                    )
                    said = pressed
                done.wait(POLL_S)
            except KeyboardInterrupt:
                pressed += 1
                if pressed >= 3:
                    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the line is the last word
                    console.print("overlapkit: tune quit; the next tune queues its trials again")
                    os._exit(130)


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
