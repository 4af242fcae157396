"""The TensorFlow training loop: the same events, step records and summary as the
torch loop, around one compiled step.

Per step it measures what can be measured from the host: ``data_wait`` (the
next batch), the compiled step (forward, backward, all-reduce and update,
fused), ``ckpt_stall`` and ``other``. The compiled step is split into
``forward``, ``backward``, ``comm_exposed`` and ``optimizer`` by a sampled
profile (see `profile`); the summary says which steps were sampled.

Checkpoints: a captured value is a zero-copy view of the variable's buffer, and
TensorFlow copies a buffer before it updates one that a view still holds
(copy on write). The view therefore stays the value "after the previous step"
through the next compiled step; the snapshot's copy into host buffers overlaps
that step, and the loop waits for it after the step (BEFORE_OPTIMIZER_STEP
fires there: the compiled step holds the optimizer, so it cannot fire inside).
"""

from __future__ import annotations

import hashlib
import statistics
from pathlib import Path
from time import perf_counter
from typing import Any

import torch

from ...runtime.distributed import World, all_gather_objects
from ...runtime.events import Event
from ...runtime.hardware import describe_node, nodes_of
from ...runtime.metrics import PhaseClock, step_record, summarize
from ...runtime.optimization import Optimization
from ...runtime.progress import ProgressBar
from ...runtime.report import LiveSteps, print_summary, write_run_files
from ...runtime.scheduler import Scheduler
from ...runtime.script import note
from ...runtime.state import State, is_warmup
from ...runtime.tensorboard import TensorBoardSteps
from . import import_tensorflow
from .data import Batches, InputPlan
from .models import build_model
from .profile import FUSED, PhaseSplit, profile_window, split_records, why_unprofiled
from .quiet_keras import keras
from .step import buffers, collectives_in, make_eval_step, make_train_step


class EvaluationFailed(RuntimeError):
    """Evaluation raised on some rank (every rank raises this, after the same gather)."""


class TfLoop:
    def __init__(
        self,
        scenario: Any,
        world: World,
        strategy: Any,
        engines: list[Any],
        optimizations: list[Optimization],
        run_dir: Path | None,
    ) -> None:
        self.tf = tf = import_tensorflow()
        self.scenario, self.world, self.strategy = scenario, world, strategy
        self.cfg = cfg = scenario.train
        self.engines, self.optimizations, self.run_dir = engines, optimizations, run_dir
        self.finished = False  # the results written (`Session.finished`)
        self.notes: list[str] = []
        train_loader, eval_loader = scenario.build_loaders(world.rank, world.world_size)
        self.batches = Batches(train_loader)
        self.eval_batches = Batches(eval_loader) if eval_loader is not None else None
        with strategy.scope():
            self.model = build_model(scenario.model, self.batches.sample_shape)
            optimizer = _optimizer(cfg)
            optimizer.build(self.model.trainable_variables)  # its slots exist before a resume
        self.optimizer = optimizer
        self.train_step = make_train_step(
            tf, strategy, self.model, optimizer, cfg, cfg.batch_size * world.world_size
        )
        self.eval_step = make_eval_step(tf, self.model)
        hooked = [e for e in engines if isinstance(e, Optimization)]
        self.scheduler = Scheduler(hooked, scenario.scheduler.policy)
        if scenario.scheduler.policy == "priority":
            self._note(
                "scheduler.policy priority: nothing inside a compiled TensorFlow step says "
                "when it waits on communication, so background work was never paused (as free)"
            )
        self.state = State(
            world=world,
            clock=PhaseClock(None),
            policy=self.scheduler.policy,
            model=self.model,
            optimizer=optimizer,
            total_steps=cfg.total_steps,
            warmup_steps=cfg.warmup_steps,
            run_dir=run_dir,
            capture=self.capture,
            restore=self.restore,
            deferrable=_every_storage,
        )
        self.records: list[dict[str, Any]] = []
        self._bar: ProgressBar | None = None
        self._logs: list[Any] = []
        self.eval_results: list[dict[str, Any]] = []

    def _note(self, message: str) -> None:
        """A line for the person running it now (rank 0), and in the summary's notes."""
        self.notes.append(message)
        if self.world.is_main:
            note(message)

    # ------------------------------------------------------------ the state

    def _variables(self) -> tuple[list[Any], list[Any]]:
        return list(self.model.variables), list(self.optimizer.variables)

    def capture(self) -> dict[str, Any]:
        """Everything a resume needs, as zero-copy torch views of the variables."""
        model, optimizer = self._variables()

        def view(variable: Any) -> torch.Tensor:
            value = getattr(variable, "value", variable).read_value()
            return torch.from_dlpack(self.tf.experimental.dlpack.to_dlpack(value))

        return {
            "model": [view(v) for v in model],
            "model_paths": [v.path for v in model],  # names for `overlapkit export`
            "optimizer": [view(v) for v in optimizer],
            "progress": {"step": self.state.step, "framework": "tensorflow"},
            "optimizations": self.scheduler.state_dict(),
        }

    def restore(self, saved: dict[str, Any]) -> None:
        if saved.get("progress", {}).get("framework") != "tensorflow":
            raise ValueError("this checkpoint was written by a torch run, not TensorFlow")
        for kind, variables in zip(("model", "optimizer"), self._variables(), strict=True):
            values = saved[kind]
            if len(values) != len(variables):
                raise ValueError(
                    f"the checkpoint's {kind} has {len(values)} variables, this one "
                    f"{len(variables)}: it was written for another model or optimizer"
                )
            for variable, value in zip(variables, values, strict=True):
                if tuple(value.shape) != tuple(variable.shape):
                    raise ValueError(
                        f"{kind} variable {variable.path}: the checkpoint holds shape "
                        f"{tuple(value.shape)}, the model {tuple(variable.shape)}"
                    )
                variable.assign(value.numpy())
        self.scheduler.load_state_dict(saved.get("optimizations", {}))
        self.state.step = saved["progress"]["step"]

    # ------------------------------------------------------------- the loop
    def run(self, progress: bool, show_summary: bool) -> dict[str, Any]:
        tf, cfg, state, world = self.tf, self.cfg, self.state, self.world
        scheduler, clock = self.scheduler, state.clock
        scheduler.fire(Event.FIT_START, state)  # may resume: state.step moves on
        start = state.step
        plan = next((e.input_plan() for e in self.engines if hasattr(e, "input_plan")), InputPlan())
        gpus = tf.config.get_visible_devices("GPU")
        if gpus:
            self._note(
                "each step's loss is read when the step ends, which waits for the GPU: "
                "TensorFlow has no device events to read later, so the step times are the "
                "device's; the tf.data pipeline's own threads still load ahead"
            )
        dataset = self.batches.train(tf, cfg.total_steps, start, plan, "/gpu:0" if gpus else None)
        batches = iter(dataset)
        self._bar = bar = (
            ProgressBar(self.scenario.name, cfg.total_steps, done=start)
            if progress and world.is_main and ProgressBar.wanted()
            else None
        )
        self._logs = logs = self._step_logs()
        window = profile_window(cfg.warmup_steps, cfg.total_steps, start, world.rank)
        # Rank 0's split, or why there is none.
        split: PhaseSplit | str = why_unprofiled(cfg.total_steps, start)
        replicas = world.world_size
        for step in range(start, cfg.total_steps):
            state.step = step
            if window is not None and step == window.start:
                clock.pause()
                window.begin(tf)
            clock.start_step()
            scheduler.fire(Event.STEP_START, state)
            with clock.phase("data_wait"):
                inputs, targets = next(batches)
            scheduler.fire(Event.AFTER_DATA, state)
            with clock.phase(FUSED):
                loss = float(self.train_step(inputs, targets))
            scheduler.fire(Event.BEFORE_OPTIMIZER_STEP, state)
            scheduler.fire(Event.AFTER_OPTIMIZER_STEP, state)
            scheduler.fire(Event.STEP_END, state)
            step_time, phases = clock.end_step()
            record = step_record(
                step=step,
                rank=world.rank,
                loss=loss,
                samples=cfg.batch_size,
                step_time_s=step_time,
                phases_s=phases,
                warmup=is_warmup(step, cfg.warmup_steps, start),
            )
            if window is not None and window.start <= step < window.stop:
                record["profiled"] = True
            self.records.append(record)
            if window is not None and step + 1 == window.stop:
                split = window.end(tf) or (
                    f"TensorFlow's profile of steps {window.start}-{window.stop - 1} "
                    "held no training step to split"
                )
                clock.pause()
            if bar is not None:
                bar.advance(record["samples_per_s"] * replicas, loss, record["warmup"])
            for log in logs:
                log.write(record, record["samples_per_s"] * replicas)
            if cfg.eval.every and (step + 1) % cfg.eval.every == 0:
                self.evaluate(step + 1)
        state.step = cfg.total_steps
        last = self.eval_results[-1]["step"] if self.eval_results else None
        failed: BaseException | None = None
        if self.eval_batches is not None and cfg.eval.at_end and last != state.step:
            try:  # the training is done: its final checkpoint and measurements are kept
                self.evaluate(state.step)
            except EvaluationFailed as error:
                failed = error.__cause__ or error
                self._note(f"evaluation at the end failed, no eval figures: {error}")
        scheduler.fire(Event.FIT_END, state)
        self._close_displays()
        summary = self.finish(split, inputs, targets, start, show_summary)
        if failed is not None:
            raise failed
        return summary

    def stopped(self) -> tuple[int, int | None]:
        """After an interrupt: close the progress bar and step logs; return the step
        reached and the step of the newest complete checkpoint (None: none)."""
        self._close_displays()
        checkpoint = next((e for e in self.engines if hasattr(e, "newest_step")), None)
        return self.state.step, checkpoint.newest_step() if checkpoint is not None else None

    def _close_displays(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        for log in self._logs:
            log.close()
        self._logs = []

    def _step_logs(self) -> list[Any]:
        """Rank 0's step logs: the live one of the run folder, TensorBoard's."""
        if not self.world.is_main:
            return []
        logs: list[Any] = [LiveSteps(self.run_dir)] if self.run_dir is not None else []
        if self.scenario.log.tensorboard is not None:
            logs.append(
                TensorBoardSteps(
                    self.scenario.log.tensorboard,
                    self.optimizations,
                    "tensorflow",
                    self.scheduler.policy.name,
                )
            )
        return logs

    def evaluate(self, step: int) -> None:
        if self.eval_batches is None:
            return
        self.state.clock.pause()  # evaluation belongs to no step
        begin = perf_counter()
        correct = total = 0
        loss_sum = 0.0
        error: Exception | None = None
        try:
            for inputs, targets in self.eval_batches.in_order(self.tf):
                right, loss = self.eval_step(inputs, targets)
                correct, total = correct + int(right), total + int(targets.shape[0])
                loss_sum += float(loss)
        except Exception as raised:  # every rank hears of it in the gather below
            error = raised
        sums = all_gather_objects(
            (correct, total, loss_sum) if error is None else f"{type(error).__name__}", self.world
        )
        failed = [f"rank {rank}: {s}" for rank, s in enumerate(sums) if isinstance(s, str)]
        if failed:
            raise EvaluationFailed(", ".join(failed)) from error
        correct, total, loss_sum = (sum(column) for column in zip(*sums, strict=True))
        self.eval_results.append(
            {
                "step": step,
                "accuracy": correct / total if total else 0.0,
                "loss": loss_sum / total if total else 0.0,
                "samples": total,
                "time_s": perf_counter() - begin,
            }
        )

    # --------------------------------------------------------------- finish
    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for variable in self.model.variables:
            digest.update(variable.numpy().tobytes())
        return digest.hexdigest()

    def finish(
        self, split: PhaseSplit | str, inputs: Any, targets: Any, start: int, show: bool
    ) -> dict[str, Any]:
        world = self.world
        collectives = collectives_in(self.train_step, inputs, targets)
        trace = (
            self.scheduler.trace.chrome_events(world.rank)
            if self.scenario.scheduler.trace
            else None
        )
        gathered = all_gather_objects(
            (self.records, split, describe_node(torch.device("cpu")), self.fingerprint(), trace),
            world,
        )
        records = sorted(
            (r for rs, *_ in gathered for r in rs), key=lambda r: (r["step"], r["rank"])
        )
        prints = [p for *_, p, _ in gathered]
        split = gathered[0][1]  # rank 0's: only rank 0 profiles
        records, split_note = split_records(records, split)
        summary: dict[str, Any] = {
            "name": self.scenario.name,
            **summarize(records, world.world_size),
        }
        summary["framework"] = "tensorflow"
        summary["phases_source"] = split_note
        if world.world_size > 1 and summary["pop"]["load_balance"] is not None:
            # Each worker's compute is rank 0's fractions of its compiled step, whose time
            # holds its waits in the all-reduces: equal on every worker, whatever each
            # computed. A compute imbalance would not show: not measured, and said.
            summary["pop"]["load_balance"] = summary["pop"]["parallel_efficiency"] = None
            self._note(
                "load balance (and parallel efficiency) not measured over several "
                "TensorFlow workers: only rank 0's step is profiled, and every worker's "
                "compiled step lasts as long, its waits in the all-reduces included"
            )
        summary["phases_profiled_steps"] = (
            None if isinstance(split, str) else [split.steps[0], split.steps[1] - 1]
        )
        fused = [r[FUSED + "_s"] for r in records if not r["warmup"]]
        summary["compiled_step_s"] = statistics.fmean(fused) if fused else None
        summary["hardware"] = {"nodes": nodes_of([node for _, _, node, *_ in gathered])}
        summary["strategy"] = {
            "name": type(self.strategy).__name__,
            "replicas": self.strategy.num_replicas_in_sync,
            "device": "cuda" if self.tf.config.get_visible_devices("GPU") else "cpu",
            "collective_ops_per_step": collectives,
            # Dense gradients' packs: the all-reduces, less the batch-norm statistics' one.
            "allreduce_packs_per_step": collectives.get("CollectiveReduceV2", 0)
            - (1 if buffers(self.model) and world.world_size > 1 else 0),
            # Every replica's weights and statistics, hashed at the end: the same bits?
            "model_sha256": prints[0],
            "replicas_identical": len(set(prints)) == 1,
            # What runs the all-reduces beside backward: with one, none can overlap it.
            "inter_op_threads": self.tf.config.threading.get_inter_op_parallelism_threads(),
        }
        optimizations = {}
        for engine in self.engines:
            if isinstance(engine, Optimization):
                optimizations[engine.name] = engine.summary()
            else:
                optimizations[engine.name] = engine.summary(summary)
        summary["optimizations"] = optimizations
        summary["scheduler"] = {
            "policy": self.scheduler.policy.name,
            "order": [opt.name for opt in self.scheduler.optimizations],
            "hooks": self.scheduler.trace.summary(),
            **self.scheduler.policy.stats(),
        }
        if start:
            summary["resumed_from_step"] = start
        if self.run_dir is not None:
            summary["run_dir"] = str(self.run_dir)
        if trace is not None:
            self.notes.append(
                "trace.json: the hooks as TensorFlow's loop fires them, on the host; "
                "before_optimizer_step and after_optimizer_step fire after the compiled "
                "step, which holds the optimizer"
            )
            trace = [event for *_, events in gathered for event in events]
        if self.notes:
            summary["notes"] = self.notes
        if self.eval_results:
            summary["eval"] = {
                "accuracy": self.eval_results[-1]["accuracy"],
                "time_s": sum(r["time_s"] for r in self.eval_results),
                "runs": self.eval_results,
            }
        if self.run_dir is not None and world.is_main:
            write_run_files(self.run_dir, records, summary, trace, resumed_at=start or None)
        self.finished = True
        if show and world.is_main:
            print_summary(summary)
        return summary


def _optimizer(cfg: Any) -> keras.optimizers.Optimizer:
    from .step import build_optimizer

    optimizer = build_optimizer(cfg)
    if cfg.precision == "fp16":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer


def _every_storage() -> None:
    """Every captured view may be copied after the compiled step (copy on write)."""
    return None
