"""The Optuna study behind ``overlapkit tune``: storage, objective, workers.

A tune folder holds ``tune.json`` (where the study lives), ``study.db`` (the
default SQLite storage), ``trials/NNNNN/`` (each trial's scenario, run folder
and stderr) and the report. The study runs in phases (`phases`), each with K
workers (a trial process each at a time) sharing the study through its
storage; here: the storage, the objective (one trial: its setting, window and
checkpoint interval in, its numbers out), the workers and the search budget.

Trials already in the study are never run twice: an interrupted ``tune`` run
again on the same folder (or storage) continues where it stopped.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import itertools
import json
import logging
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy
from optuna.trial import FrozenTrial, TrialState

from ..launch.interrupt import stop_asked, stop_if_asked
from ..launch.local import alive
from ..launch.ray_nodes import OutOfTime, RayClusterError
from ..optimizations import get_optimization
from ..runtime.hardware import hardware_label
from ..runtime.plain_data import first_difference
from . import TuneError
from .checkpoint_model import CheckpointPlan, probe_cost, taken_in_window
from .config import TuneConfig
from .goodput import checkpoint_figures, checkpoints_taken, goodput, priced_efficiency
from .measured import PLAN_ATTR, PROBE, QUEUED_AGAIN, SEARCH_STEPS_ATTR, UNUSED
from .space import SearchSpace, apply_params, build_space, checkpoint_by_model
from .trial import (
    NODE_LOST,
    TrialFailed,
    TrialStopped,
    run_trial,
    trial_scenario,
    with_checkpoints,
)

TUNE_FILE = "tune.json"
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
COUNTED = (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING)  # toward repeats
METRICS = ("throughput", "goodput")


@dataclass
class TuneJob:
    """Everything a study's workers need, as plain data."""

    base: dict[str, Any]  # the scenario, as plain data
    tune: TuneConfig
    folder: Path
    storage_url: str
    study_name: str

    @property
    def space(self) -> SearchSpace:
        return build_space(
            self.base.get("optimizations") or {}, self.tune, self.base.get("framework", "torch")
        )

    @property
    def objectives(self) -> list[str]:
        return list(METRICS) if self.tune.objective == "both" else [self.tune.objective]

    @property
    def checkpoint_by_model(self) -> bool:
        """The checkpoint's interval comes from the goodput model, not the search."""
        return checkpoint_by_model(self.base.get("optimizations") or {}, self.tune)

    def rare_checkpoints(self) -> list[int]:
        """The checkpoint intervals searched (in steps) that a trial is too short to
        reach (with ``final`` off, a trial of N steps checkpoints at steps below N):
        such settings take no checkpoint there, so their cost goes unmeasured."""
        space = self.space
        if "checkpoint" not in space.optimizations:
            return []
        checkpoint = get_optimization("checkpoint")
        length = self.tune.trial_steps
        own = [d for d in space.dimensions if d.owner == "checkpoint"]
        others = {d.name: d.values()[0] for d in space.dimensions if d.owner != "checkpoint"}
        rare = set()
        for values in itertools.product(*(d.values() for d in own)):
            params = {**others, **{d.name: v for d, v in zip(own, values, strict=True)}}
            entry = apply_params(self.base, space, params)["optimizations"].get("checkpoint")
            if entry is None:
                continue  # off
            entry = dict(entry)
            settings = checkpoint.resolve(entry.pop("intensity", 1.0), entry)
            if not settings["auto"] and settings["every"] >= length:
                rare.add(settings["every"])
        return sorted(rare)

    def save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        own = self.storage_url == default_storage(self.folder)
        document = {
            # null: the folder's own study.db, wherever the folder is copied or moved
            "storage": None if own else self.storage_url,
            "study": self.study_name,
            "scenario": self.base,
            "tune": self.tune.model_dump(mode="json"),
        }
        (self.folder / TUNE_FILE).write_text(json.dumps(document, indent=2) + "\n")

    @classmethod
    def load(cls, folder: Path) -> TuneJob:
        document = json.loads((folder / TUNE_FILE).read_text())
        return cls(
            document["scenario"],
            TuneConfig(**document["tune"]),
            folder,
            _own_storage(document["storage"], folder),
            document["study"],
        )


def default_storage(folder: Path) -> str:
    return f"sqlite:///{folder.resolve() / 'study.db'}"


def _own_storage(url: str | None, folder: Path) -> str:
    """The storage a tune file names: its folder's own study.db when none (or, in a
    file written before that was recorded so, a study.db of the folder it was copied
    from while this one holds its own)."""
    copied = url is not None and url.startswith("sqlite:///") and url.endswith("/study.db")
    if url is None or (copied and (folder / "study.db").is_file()):
        return default_storage(folder)
    return url


class _OneChangeAtATime(optuna.storages.RDBStorage):
    """Optuna's database storage, changing trials' states one at a time. A queued trial
    is taken by setting it running where it still waits, a running one failed where
    it still runs, under a row lock that SQLite does not have: two of tune's threads
    taking trials at once both took the same one (and its second run found the
    first's folder in use), and so did two tune commands on one SQLite file. Here a
    lock of this process and, for a SQLite file, a lock on a file beside it make the
    changes one at a time. PostgreSQL's row lock holds across processes and machines
    by itself. A trial whose worker stopped beating has its setting queued again
    (once) and is marked interrupted before Optuna fails it."""

    _changing = threading.Lock()  # one for every storage of this process

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        database = sqlalchemy.engine.make_url(url).database if url.startswith("sqlite") else None
        on_disk = database not in (None, "", ":memory:")
        self.changing_lock = f"{database}.taking.lock" if on_disk else None

    @contextlib.contextmanager
    def one_at_a_time(self) -> Iterator[None]:
        with self._changing, _file_lock(self.changing_lock):
            yield

    def set_trial_state_values(
        self, trial_id: int, state: TrialState, values: Sequence[float] | None = None
    ) -> bool:
        with self.one_at_a_time():
            return super().set_trial_state_values(trial_id, state, values)

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        stale = super()._get_stale_trial_ids(study_id)
        for trial_id in stale:
            trial = self.get_trial(trial_id)
            reason = f"its worker stopped (no heartbeat for {self.grace_period:g} s)"
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                # (another process may have failed it meanwhile, and queued it)
                stopped_before_its_end(self, study_id, trial, reason, once=True)
        return stale


def stopped_before_its_end(
    storage: optuna.storages.BaseStorage, study_id: int, trial: FrozenTrial, reason: str, once: bool
) -> None:
    """Mark a running ``trial`` whose worker is gone, after queuing its setting again
    (its copy holds its place in the search budget from then on): unless it never got
    a setting, or, with ``once``, it was run again once already (failed for good)."""
    role, retried = trial.user_attrs.get("role"), bool(trial.user_attrs.get("retry"))
    # Its setting: chosen and running, or queued for it (its worker died as it took it).
    params = (
        trial.params if "folder" in trial.user_attrs else trial.system_attrs.get("fixed_params")
    )
    ran = params is not None and role not in (None, UNUSED)
    if ran and not (once and retried):
        _queue_copy(storage, study_id, trial, params, retry=once)
        marks = {"failure": "interrupted", "reason": reason}
    elif ran:
        marks = {"failure": "lost", "reason": f"{reason}, for the second time: not run again"}
    else:
        marks = {"failure": "interrupted", "reason": f"{reason} before it ran"}
    for key, value in marks.items():
        storage.set_trial_user_attr(trial._trial_id, key, value)


def queue_again(
    study: optuna.Study, trial: optuna.Trial, params: dict[str, Any], retry: bool = False
) -> None:
    """Queue the setting ``params`` of ``trial``, stopped before its end, to run again:
    the copy names it, and holds its place in the search budget."""
    _queue_copy(study._storage, study._study_id, trial, params, retry)


def _queue_copy(
    storage: optuna.storages.BaseStorage,
    study_id: int,
    trial: FrozenTrial | optuna.Trial,
    params: dict[str, Any],
    retry: bool,
) -> None:
    """Queue a copy of ``trial`` (its setting ``params``), unless it is no longer
    running (it ended as another machine found it late to beat) or a copy is queued
    already (its worker queued it as it stopped, and another found it gone)."""
    backend = getattr(storage, "_backend", storage)  # Optuna's cache wraps it
    lock = backend.one_at_a_time() if isinstance(backend, _OneChangeAtATime) else None
    with lock or contextlib.nullcontext():
        if storage.get_trial(trial._trial_id).state != TrialState.RUNNING:
            return
        trials = storage.get_all_trials(study_id, deepcopy=False)
        if any(t.user_attrs.get("again_of") == trial.number for t in trials):
            return
        attrs: dict[str, Any] = {
            key: trial.user_attrs[key] for key in QUEUED_ATTRS if key in trial.user_attrs
        }
        attrs["again_of"] = trial.number
        attrs.setdefault("role", None)
        if retry:
            attrs["retry"] = True
        copy = optuna.trial.create_trial(
            state=TrialState.WAITING, system_attrs={"fixed_params": params}, user_attrs=attrs
        )
        storage.create_new_trial(study_id, template_trial=copy)


@contextlib.contextmanager
def _file_lock(path: str | None) -> Iterator[None]:
    """Held by one process at a time (of those on this machine; none when no path)."""
    if path is None:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and the lock with it


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """An Optuna storage for ``url``: ``journal:PATH`` for a journal file, else a
    database URL (sqlite:///..., postgresql+psycopg2://...). Database storages
    keep a heartbeat, so a trial whose worker died is failed and run again."""
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(url.removeprefix("journal:")))
    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    for attempt in range(SCHEMA_ATTEMPTS):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return _OneChangeAtATime(
                    url,
                    engine_kwargs=engine_kwargs,
                    heartbeat_interval=15,
                    grace_period=60,
                )
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError) as error:
            # Two processes creating a new storage's tables at once (a driver and a
            # dashboard, workers on several machines): the second one's insert of the
            # schema version collides. The tables are there now: open it again.
            racing = isinstance(error, sqlalchemy.exc.IntegrityError) or "already exists" in str(
                error
            )
            if not racing or attempt == SCHEMA_ATTEMPTS - 1:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


SCHEMA_ATTEMPTS = 5


def open_study(job: TuneJob, queued: bool = False) -> optuna.Study:
    """The study of ``job``. ``queued``: only queued trials will run (their parameters
    are fixed), so the sampler is a plain one (the grid sampler would stop the study
    after each trial once its grid is done)."""
    tune, space = job.tune, job.space
    sampler: optuna.samplers.BaseSampler
    if queued:
        sampler = optuna.samplers.RandomSampler()
    elif tune.sampler == "grid":
        sampler = optuna.samplers.GridSampler(space.grid(), seed=tune.seed)
    elif tune.sampler == "random":
        sampler = optuna.samplers.RandomSampler(seed=tune.seed)
    else:
        sampler = optuna.samplers.TPESampler(multivariate=True, n_startup_trials=5, seed=tune.seed)
    # The running figure a trial reports is its throughput: it ranks settings for that
    # objective only (a slower setting with checkpoints may have the best goodput).
    prunes = tune.prune and job.objectives == ["throughput"]
    pruner = (
        optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=max(2, tune.steps // 3))
        if prunes
        else optuna.pruners.NopPruner()
    )
    study = optuna.create_study(
        storage=open_storage(job.storage_url),
        study_name=job.study_name,
        directions=["maximize"] * len(job.objectives),
        sampler=sampler,
        pruner=pruner,
        load_if_exists=True,
    )
    if len(study.directions) != len(job.objectives):
        raise TuneError(
            f"study {job.study_name!r} exists with {len(study.directions)} objective(s); "
            f"this tune asks for {job.tune.objective}: use another --study"
        )
    measured = study.user_attrs.get("scenario")
    change = measured is not None and first_difference(_trials_of(measured), _trials_of(job.base))
    if change:
        raise TuneError(
            f"study {job.study_name!r} in {job.storage_url} was measured with another "
            f"scenario ({change}): this tune's trials would be mixed with its own; use "
            "another --out or --study (or the scenario it measured, to continue it)"
        )
    tuned = study.user_attrs.get("tune")
    now = job.tune.model_dump(mode="json")
    change = tuned is not None and first_difference(_measured(tuned), _measured(now), "tune")
    if change:
        raise TuneError(
            f"study {job.study_name!r} in {job.storage_url} was tuned with another tune "
            f"section ({change}): this tune's trials would be measured or ranked otherwise "
            "than its own; use another --out or --study (or its tune section, to continue it)"
        )
    if tuned is not None and tuned != now:  # the report prices goodput at these figures
        study.set_user_attr("tune", now)
    if "objectives" not in study.user_attrs:
        study.set_metric_names(job.objectives)
        study.set_user_attr("objectives", job.objectives)
        study.set_user_attr("scenario", job.base)
        study.set_user_attr("tune", job.tune.model_dump(mode="json"))
    return study


# What a study's trials are and how they are measured and ranked; the rest of a tune
# section (trials, finalists, repeats, the goodput figures a report prices at...) may
# change when a study is continued.
MEASURED = (
    "objective",
    "search",
    "intensity_step",
    "policy",
    "steps",
    "warmup_steps",
    "window_se",
    "max_steps",
    "checkpoint_interval",
)
# The attributes a queued trial carries to its copy, were it stopped before its end:
# its role, its round, its window (``steps``: asked for when queued, then the steps
# its run measured, the same), and a probe's interval and setting.
QUEUED_ATTRS = ("role", "block", "steps", "probe_every", "probe_of")



def _measured(tune: dict[str, Any]) -> dict[str, Any]:
    return {key: tune.get(key) for key in MEASURED}


def _trials_of(scenario: dict[str, Any]) -> dict[str, Any]:
    """What a study's trials measure: the scenario without its tune section (whose
    trial count may grow when a study is continued) and its log section (where
    TensorBoard files go)."""
    return {key: value for key, value in scenario.items() if key not in ("tune", "log")}


# ------------------------------------------------------------------ one trial
def trial_metrics(
    summary: dict[str, Any], tune: TuneConfig, plan: CheckpointPlan | None = None
) -> dict[str, Any]:
    """The numbers a trial records: both objectives and where the step's time went.
    ``plan``: the model's checkpoint interval, which the trial is priced at (see
    `CheckpointPlan.price`)."""
    interval_s, persist_s = checkpoint_figures(summary)
    throughput = summary["samples_per_s"]
    step_s = summary["step_time_s"]["mean"]
    steps = summary.get("steps") or 0
    section = (summary.get("optimizations") or {}).get("checkpoint") or {}
    every = section.get("every") if isinstance(section.get("every"), int) else None
    taken = taken_in_window(every, tune.warmup_steps, steps)
    if plan is not None:
        runtime = summary.get("runtime_s") or steps * step_s
        priced = plan.price(throughput, runtime, steps, taken)
        share, value = priced["share"], priced["goodput"]
    else:
        share = priced_efficiency(interval_s, persist_s, tune)
        value = goodput(throughput, share)
    return {
        "throughput": throughput,
        "goodput": value,
        "checkpoint_interval_s": interval_s,
        "checkpoints": checkpoints_taken(summary),
        "checkpoints_in_window": taken,
        "runtime_s": summary.get("runtime_s"),
        "checkpoint_model": plan is not None,
        "checkpoint": probe_cost(summary),  # the checkpoint's figures, its cost among them
        "persist_s": persist_s,
        "efficiency": share,
        "step_time_s": step_s,
        "steps": summary.get("steps"),
        "se_rel": summary["step_time_s"].get("se_rel"),
        "phase_shares": summary["phase_shares"],
        "background_chunks_yielded": summary["scheduler"].get("background_chunks_yielded", 0),
        "hardware": hardware_label(summary.get("hardware")),
    }


def study_plan(study: optuna.Study) -> CheckpointPlan | None:
    recorded = study.user_attrs.get(PLAN_ATTR)
    return CheckpointPlan.from_dict(recorded) if recorded else None


Runner = Callable[..., dict[str, Any]]  # `trial.run_trial`'s shape: (data, folder, timeout, watch)


class TrialTakenWarning(UserWarning):
    """A trial ended here after another machine took it for lost."""


class TakenElsewhere(RuntimeError):
    """This worker's trial was failed meanwhile by another machine (or thread) that
    found its heartbeat late: Optuna refuses to record its end."""


class Objective:
    def __init__(
        self,
        job: TuneJob,
        queued: bool = False,
        runner: Runner | None = None,
    ) -> None:
        self.job, self.space, self.queued = job, job.space, queued
        self.runner = runner or run_trial
        self.calls = 0  # trials started
        self.taken: list[int] = []  # those another machine took for lost as they ran here
        self._counting = threading.Lock()

    def __call__(self, trial: optuna.Trial) -> float | tuple[float, ...]:
        with self._counting:
            self.calls += 1
        try:
            return self._measure(trial)
        except Exception:
            self._unless_taken(trial)
            raise

    def _unless_taken(self, trial: optuna.Trial) -> None:
        """Raise `TakenElsewhere` (and say so) when ``trial`` is no longer running in
        the study: its worker's heartbeat was late (a machine paused, a database out
        of reach for a minute), so it was failed and its setting queued again."""
        now = trial.study._storage.get_trial(trial._trial_id)
        if now.state == TrialState.RUNNING:
            return
        with self._counting:
            self.taken.append(trial.number)
        copies = [
            t.number
            for t in trial.study.get_trials(deepcopy=False)
            if t.user_attrs.get("again_of") == trial.number
        ]
        again = f"its setting runs again as trial {copies[0]}" if copies else "not run again"
        reason = now.user_attrs.get("reason", "its heartbeat was late")
        warnings.warn(
            f"trial {trial.number} ended here after it was taken for lost ({reason}): "
            f"what it measured is dropped, {again}",
            TrialTakenWarning,
            stacklevel=2,
        )
        raise TakenElsewhere(f"trial {trial.number} was taken for lost")

    def _measure(self, trial: optuna.Trial) -> float | tuple[float, ...]:
        job = self.job
        if self.queued and "role" not in trial.user_attrs:
            # Another machine took the last queued setting after this worker looked.
            trial.set_user_attr("role", UNUSED)
            trial.study.stop()
            raise optuna.TrialPruned("the queue was empty")
        origin = trial.user_attrs.get("again_of")
        if origin is not None and _copied_twice(trial, origin):
            trial.set_user_attr("role", UNUSED)
            raise optuna.TrialPruned("its setting runs in the copy queued first")
        trial.set_user_attr("role", trial.user_attrs.get("role", "search"))
        trial.set_user_attr("host", socket.gethostname())  # its worker, alive
        trial.set_user_attr("pid", os.getpid())
        # A setting queued again holds the place of the trial it copies.
        searching = trial.user_attrs["role"] == "search" and "again_of" not in trial.user_attrs
        if searching and _over_budget(trial, job.tune.trials):
            # Workers on other machines filled the budget while this one started.
            trial.set_user_attr("role", UNUSED)
            trial.study.stop()
            raise optuna.TrialPruned("the search budget is spent")
        params = self.space.suggest(trial)
        folder = job.folder / "trials" / f"{trial.number:05d}"
        trial.set_user_attr("folder", str(folder))
        study_attrs = trial.study.user_attrs
        steps = trial.user_attrs.get("steps") or study_attrs.get(SEARCH_STEPS_ATTR) or job.tune.steps
        plan = study_plan(trial.study) if job.checkpoint_by_model else None
        if trial.user_attrs["role"] == PROBE:
            plan = None  # (a probe's interval is its own; its goodput is its run's)
        data = apply_params(job.base, self.space, params)
        if trial.user_attrs["role"] == PROBE:
            data = with_checkpoints(data, trial.user_attrs["probe_every"])
        elif plan is not None:
            data = with_checkpoints(data, plan.every if plan.on else None)
        data = trial_scenario(data, steps, job.tune.warmup_steps)
        log = data.get("log") or {}
        if log.get("tensorboard"):  # each trial its own TensorBoard run
            log["tensorboard"] = str(Path(log["tensorboard"]) / f"trial-{trial.number:05d}")
        watch = None
        # Only the sampler's trials are pruned: the others are the report's reference rows.
        prunable = trial.user_attrs["role"] == "search"
        if prunable and isinstance(trial.study.pruner, optuna.pruners.MedianPruner):

            def watch(step: int, value: float) -> bool:
                trial.report(value, step)
                return trial.should_prune()

        try:
            stop_if_asked()  # Ctrl-C as the trial was set up: no process started for it
            summary = self.runner(data, folder, job.tune.trial_timeout_s, watch)
        except TrialStopped:
            raise optuna.TrialPruned() from None
        except (KeyboardInterrupt, RayClusterError) as stop:
            # Ctrl-C, or a cluster with no room for the trial: not the setting's fault;
            # it runs again when the study continues.
            # Queued first: from then on its copy holds its place in the search budget.
            queue_again(trial.study, trial, params)
            room = isinstance(stop, RayClusterError)
            trial.set_user_attr("failure", "no_room" if room else "interrupted")
            trial.set_user_attr("reason", str(stop) if room else "tune was stopped while it ran")
            if isinstance(stop, OutOfTime):  # tune's --timeout: the study ends as usual
                raise TrialFailed("no_room", str(stop)) from None
            raise
        except TrialFailed as failure:
            trial.set_user_attr("failure", failure.kind)
            trial.set_user_attr("reason", failure.reason)
            if failure.kind == NODE_LOST and not trial.user_attrs.get("retry"):
                # Not the setting's fault: run it once more, on machines still there.
                queue_again(trial.study, trial, params, retry=True)
                trial.set_user_attr("queued_again", True)
            raise
        self._unless_taken(trial)
        metrics = trial_metrics(summary, job.tune, plan)
        for key, value in metrics.items():
            trial.set_user_attr(key, value)
        values = tuple(metrics[name] for name in job.objectives)
        return values[0] if len(values) == 1 else values


ROLE_WAIT_S = 10.0  # a trial says its role milliseconds after it is made; longer: it died


def _over_budget(trial: optuna.Trial, budget: int) -> bool:
    """Whether ``budget`` search trials numbered before this one were started: of
    trials started at once, the lower numbers go first. A trial stopped before its end
    whose setting was queued again still holds its place (its copy runs in it), one
    marked so with no copy does not. An earlier trial that has not said its role yet
    (made a moment ago, on this machine or another) is waited for: counted as nothing,
    two trials started at once would both take the budget's last place."""
    deadline = time.monotonic() + ROLE_WAIT_S
    while True:
        trials = trial.study.get_trials(deepcopy=False)
        earlier = [t for t in trials if t.number < trial.number and t.state != TrialState.WAITING]
        unsaid = [
            t for t in earlier if t.state == TrialState.RUNNING and "role" not in t.user_attrs
        ]
        if not unsaid or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    copied = {t.user_attrs.get("again_of") for t in trials}
    places = [
        t
        for t in earlier
        if t.user_attrs.get("role") == "search"
        and "again_of" not in t.user_attrs
        and (t.number in copied or not queued_again(t))
    ]
    return len(places) >= budget


def _copied_twice(trial: optuna.Trial, origin: int) -> bool:
    """Whether a copy of trial ``origin`` numbered before this one exists (two machines
    found its worker gone at once, and each queued it)."""
    trials = trial.study.get_trials(deepcopy=False)
    return any(t.user_attrs.get("again_of") == origin and t.number < trial.number for t in trials)


def queued_again(trial: FrozenTrial) -> bool:
    """An interrupted trial, one the cluster had no room for or one whose machine was
    lost: its setting runs again, so it does not count against the search budget."""
    return trial.user_attrs.get("failure") in QUEUED_AGAIN or bool(
        trial.user_attrs.get("queued_again")
    )


def quiet_optuna() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # On the handlers: the records come from Optuna's modules' own loggers.
    for handler in logging.getLogger("optuna").handlers:
        if not any(isinstance(f, _NoFailedTrialLines) for f in handler.filters):
            handler.addFilter(_NoFailedTrialLines())
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


class _NoFailedTrialLines(logging.Filter):
    """Failed trials are said by the trial lines; Optuna would add each one's
    traceback. Its other warnings (storage retries, heartbeats) still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Trial ") and " failed" in message)


def worker_main(
    job: TuneJob,
    n_trials: int,
    deadline: float | None,
    callbacks: list[Callable[[optuna.Study, FrozenTrial], None]] | None = None,
    queued: bool = False,
    runner: Runner | None = None,
    in_flight: int = 1,
) -> None:
    """Run up to ``n_trials`` trials of the study (queued ones first; ``queued``: only
    those), ``in_flight`` at once, each from a thread of its own. It also stops when
    the study, which other machines may share, has its search budget (counting
    trials running elsewhere), or, with ``queued``, when nothing is left in the
    queue. ``runner``: how a trial runs (default: `run_trial` here, on whatever
    this process sees)."""
    quiet_optuna()
    study = open_study(job, queued)
    if stop_asked():  # Ctrl-C as the phase started
        return
    budget = job.tune.trials

    def done() -> bool:
        if stop_asked() or (deadline is not None and time.time() >= deadline):
            return True  # Ctrl-C as a trial ended, or out of time: start no other
        return (waiting(study) == 0) if queued else (search_done(study, running=True) >= budget)

    def enough(study: optuna.Study, trial: FrozenTrial) -> None:
        if done():
            study.stop()

    objective = Objective(job, queued, runner)
    while objective.calls < n_trials:
        taken = len(objective.taken)
        try:
            study.optimize(
                objective,
                n_trials=n_trials - objective.calls,
                n_jobs=in_flight,
                timeout=None if deadline is None else max(1.0, deadline - time.time()),
                catch=(TrialFailed,),
                callbacks=[*(callbacks or []), enough],
            )
            return
        except Exception:
            # Optuna refuses to record the end of a trial failed meanwhile elsewhere,
            # and stops: go on with the others (that trial's copy among them).
            if len(objective.taken) == taken:
                raise
        if done():
            return


# --------------------------------------------------------------------- phases
UNCLAIMED_ORPHAN_S = 120  # a running trial with no worker recorded after this long is lost


def fail_orphans(study: optuna.Study) -> list[int]:
    """Trials left running by a worker of this machine that is gone (an interrupted
    tune): mark them failed and queue their settings again. Returns their numbers."""
    host, orphans = socket.gethostname(), []
    now = datetime.datetime.now()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        pid = trial.user_attrs.get("pid")
        if pid is None:
            # Its worker died before recording itself (that takes milliseconds): an
            # orphan once it is old, wherever it ran.
            started = trial.datetime_start or now
            if (now - started).total_seconds() < UNCLAIMED_ORPHAN_S:
                continue
        elif trial.user_attrs.get("host") != host or alive(pid):
            continue
        storage, reason = study._storage, f"its worker (pid {pid}) is gone"
        try:
            stopped_before_its_end(storage, study._study_id, trial, reason, once=False)
            storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # failed meanwhile elsewhere (its heartbeat stale), and queued there
        orphans.append(trial.number)
    return orphans


def waiting(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))


def search_done(study: optuna.Study, running: bool = False) -> int:
    """The sampler's trials that count against its budget (an interrupted one does
    not: it is queued again); ``running``: also those running now, here or elsewhere."""
    states = (*FINISHED, TrialState.RUNNING) if running else FINISHED
    return sum(
        1
        for t in study.get_trials(deepcopy=False, states=states)
        if t.user_attrs.get("role") == "search" and not queued_again(t)
    )
