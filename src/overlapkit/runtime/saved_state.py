"""The `Session`'s state for checkpoints: what is saved, and `save`/`load` in the
checkpoint optimization's format. (A part of `Session`; see `session`.)"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.swa_utils import AveragedModel

from ..data import SequenceLoader
from .arguments import check_not_sharded
from .batch import tensors_in
from .model_copies import CopyFinder, ModelCopy, same_weights
from .optimization import optimization_class
from .rng import capture_rng, restore_rng, same_rng
from .script import Start, note, script_variables, warn
from .state import temporarily

# A rank that has waited this long in `save` for the others to call it says so.
SAVE_WAIT_TOLD_S = 10.0


class SavedState:
    """`Session` methods for saving and resuming (mixed into `Session`)."""

    def register_for_checkpointing(self, name: str, obj: Any) -> None:
        """Save and restore ``obj``: anything with ``state_dict``/``load_state_dict``
        (an LR schedule stepped per epoch, an EMA...), a dict (restored in place), or a
        function returning a plain value (``lambda: best_acc``; after a resume the
        saved value is in ``session.start().values[name]``). None is nothing to save
        (``start(model_ema=model_ema, scaler=scaler)`` whether or not the script made
        them, as torchvision's saves each ``if model_ema:``)."""
        if obj is None:
            return
        if self._started:
            raise RuntimeError(
                f"register {name!r} before the run starts (before start(), epoch() or steps()): "
                "a resume has already restored the state"
            )
        if isinstance(obj, torch.nn.Module):  # a GAN's generator is synced as the model
            check_not_sharded(obj, name)
        if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
            self._stateful[name] = _ShardState(obj) if _sharded_optimizer(obj) else obj
            if isinstance(obj, torch.optim.Optimizer):  # a second model's (a GAN's)
                self._plain_calls.watch_update(obj)
                self.state.other_optimizers.append(obj)
            elif isinstance(obj, torch.nn.Module):  # a second model (a GAN's generator)
                self._plain_calls.watch_forward(obj)
        elif isinstance(obj, dict):
            self._stateful[name] = _DictState(obj)
        elif callable(obj):
            self._values.add(name, obj)
        else:
            raise TypeError(
                f"cannot checkpoint {name}={obj!r}: pass a function that returns it "
                f"({name}=lambda: {name}), a dict, or an object with state_dict()"
            )
        if name in self._stateful and name in self._loaded_user:
            # Registered after session.load() (start(scheduler=...) after it): restored
            # now, as if registered before (it kept its fresh state, silently).
            self._stateful[name].load_state_dict(self._loaded_user[name])

    def holds(self, obj: Any) -> bool:
        """``obj`` is checkpointed: registered, held by a registered object (timm's
        NativeScaler holds the scaler), or the LR schedule given to `prepare`."""
        held = [*self._stateful.values(), self.state.lr_scheduler]
        held += [value for owner in held for value in getattr(owner, "__dict__", {}).values()]
        # A registered module's own modules (a target net in a registered ModuleDict).
        held += [m for owner in held if isinstance(owner, torch.nn.Module) for m in owner.modules()]
        return any(owner is obj for owner in held)

    def holds_storage_of(self, tensors: list[torch.Tensor]) -> bool:
        """One of ``tensors`` shares its storage with a tensor a registered object or
        value would checkpoint now (a dict holding an RNN's hidden state)."""
        wanted = {tensor.untyped_storage().data_ptr() for tensor in tensors}
        saved = [obj.state_dict() for obj in self._stateful.values()]
        saved.append(self._values.state_dict())
        return any(held.untyped_storage().data_ptr() in wanted for held in tensors_in(saved))

    def check_unsaved_state(self) -> None:
        """As a checkpointed run starts: the script's state that a resume would restart
        silently, unregistered. Its LR schedule (torch's set ``initial_lr`` in the
        optimizer's param groups): the learning rate would be the saved one, but the
        schedule's count would start again. An EMA or SWA copy of the model
        (``AveragedModel``, among the variables of the function starting the run): its
        average would start again from the resumed model. Without an optimizer: what
        the script's own update reads is said to be its to register, with the names
        registered (word_language_model anneals its ``lr`` by hand)."""
        state = self.state
        if not self.checkpointing or not self.runs_a_script:
            return
        if state.optimizer is None:
            if self._raw_model is not None:
                names = [*self._stateful, *self._values.getters]
                self._note(
                    "prepare() was given no optimizer: the script updates the parameters "
                    "itself, and checkpoints hold them, but of what its update reads (a "
                    "learning rate it anneals by hand, momentum buffers) only what it "
                    f"registers ({', '.join(names) or 'nothing'} here): register the "
                    "rest, session.start(lr=lambda: lr), and take it back from "
                    "start.values, or a resume goes on with its first value"
                )
            return
        unsaved = []
        where, variables = script_variables()  # the function starting the run's
        scheduled = any("initial_lr" in group for group in state.optimizer.param_groups)
        # torch's schedules, or another library's that steps this optimizer (timm's).
        schedules = [
            obj
            for obj in self._stateful.values()
            if isinstance(obj, LRScheduler)
            or any(value is state.optimizer for value in getattr(obj, "__dict__", {}).values())
        ]
        if scheduled and state.lr_scheduler is None and not schedules:
            # By the script's own name for it (transfer_learning's exp_lr_scheduler).
            schedulers = {
                name: value
                for name, value in variables.items()
                if isinstance(value, LRScheduler) and value.optimizer is state.optimizer
            }
            inner = {id(s) for v in schedulers.values() for s in getattr(v, "_schedulers", [])}
            # The outermost (a SequentialLR's, not its warm-up's: that left its milestones).
            named = [name for name, value in schedulers.items() if id(value) not in inner]
            name = named[0] if named else "lr_scheduler"
            unsaved.append(
                "the optimizer's LR schedule is not checkpointed: a resumed run would start "
                f"its count again, from the saved learning rate. Register it: "
                f"session.start({name}={name}) (one stepped per epoch; one "
                "stepped per update can go to prepare() instead)"
            )
        for name, value in variables.items():
            if isinstance(value, AveragedModel) and not self.holds(value):
                unsaved.append(
                    f"{name} (an AveragedModel) is not checkpointed: a resumed run would "
                    f"start its average again. Register it: session.start({name}={name})"
                )
        unsaved += self._unsaved_optimizers(variables)
        self._watch_copies(where, variables)  # told once the run changes them
        for message in unsaved:
            self.notes.append(f"cannot resume exactly: {message}")
            warn(message)

    def _unsaved_optimizers(self, variables: dict[str, Any]) -> list[str]:
        """A second optimizer among ``variables`` (seq2seq's encoder and decoder, each
        its own), and the module it trains, that nothing checkpoints: a resume started
        them again as the script made them (its decoder 0.0095 off after 9 steps),
        silently."""
        modules = [self._raw_model, *self._stateful.values()]
        saved = {id(p) for m in modules if isinstance(m, torch.nn.Module) for p in m.parameters()}
        unsaved = []
        for name, value in variables.items():
            if not isinstance(value, torch.optim.Optimizer) or value is self.state.optimizer:
                continue
            params = {id(p) for group in value.param_groups for p in group["params"]}
            left = [] if self.holds(value) else [f"{name} (an optimizer)"]
            left += [
                f"{module_name} (the module {name} trains)"
                for module_name, module in variables.items()
                if isinstance(module, torch.nn.Module)
                and module is not self._raw_model
                and not self.holds(module)
                and params & {id(p) for p in module.parameters()} - saved
            ]
            if left:
                names = [part.split(" ")[0] for part in left]
                unsaved.append(
                    f"{' and '.join(left)} not checkpointed: a resumed run would start "
                    f"{'them' if len(left) > 1 else 'it'} again as the script made "
                    f"{'them' if len(left) > 1 else 'it'}. Register: session.start("
                    + ", ".join(f"{n}={n}" for n in names)
                    + ")"
                )
        return unsaved

    def _watch_copies(self, where: Any, variables: dict[str, Any]) -> None:
        """Watch the copies of the model's weights among ``variables`` (of the script's
        function ``where``, at the start and at each checkpoint: airbench makes its
        lookahead EMA epochs in) that nothing registered holds."""
        if self._raw_model is None:
            return
        self._copy_finder = finder = CopyFinder(self._raw_model)
        watched = {id(copy.value) for copy in self._copies.values()}
        for name, value in variables.items():
            if name in self._copies or name in self._copies_told or id(value) in watched:
                continue
            if isinstance(value, AveragedModel):
                continue  # told at the start (its average, even before any change)
            found = finder.copy_of(value)
            if found is None or self.holds(value) or self.holds_storage_of(found[0]):
                continue
            with contextlib.suppress(Exception):  # its sums could not be read: not watched
                self._copies[name] = ModelCopy(value, *found, where=where)
                self._copies[name].seen_at = self.state.step

    def _weights_kept(
        self, value: Any, found: tuple[list[torch.Tensor], str] | None, modules: list[Any]
    ) -> bool:
        """``value``, a dict of the model's weights bound anew since the last look,
        holds weights none of ``modules`` does: the best so far (transfer_learning's
        ``best_model_wts = copy.deepcopy(model.state_dict())``), not the model's own
        nor those of a module a checkpoint or this watch holds (DQN's soft update
        builds its target network's next state dict in a variable each step)."""
        if not isinstance(value, dict) or found is None:
            return False
        # A module's, or one it holds (a registered AveragedModel's .module).
        held = [sub for m in modules for sub in (m, *m.children())]
        return not any(same_weights(found[0], m) for m in held)

    def _check_copies_changed(self, wait: bool = False) -> None:
        """As a checkpoint is taken (and as the run ends: ``wait`` for a GPU's sums):
        an unregistered copy of the model's weights that the run changed since it was
        first seen (a target network soft-updated from the model, an EMA kept by hand)
        would start again as the script made it in a resume, silently. One left as it
        was (a frozen reference model, a teacher) is no matter; so is a variable bound
        to a new copy (one made anew for an evaluation), watched from then on."""
        finder = self._copy_finder
        if finder is None:  # not watching: no checkpoints, or no script's
            return
        where, variables = script_variables()
        modules = [self._raw_model, *self._stateful.values()]
        modules += [copy.value for copy in self._copies.values()]
        modules += list(self._copies_told.values())
        modules = [m for m in modules if isinstance(m, torch.nn.Module)]
        rebound: dict[str, bool] = {}  # bound anew since the last look: to weights kept?
        for name, copy in list(self._copies.items()):
            value = variables.get(name, copy.value) if where is copy.where else copy.value
            found = finder.copy_of(value)
            try:
                if value is not copy.value or found is None:
                    # Bound anew, watched again below (a copy made for an evaluation, a
                    # state dict built each step), or no copy now. A dict bound anew to
                    # weights nothing else holds, still that dict at the next look, is
                    # weights kept (the best so far): told then.
                    rebound[name] = self._weights_kept(value, found, modules)
                    del self._copies[name]
                    continue
                # Kept weights are told once a step went by with them still named (at
                # the run's end right after a checkpoint, a dict built each step stays).
                kept = copy.kept and self.state.step > copy.seen_at
                if not kept and not copy.changed(found[0], wait):
                    continue
            except Exception:  # noqa: BLE001 - a look that failed fails no checkpoint
                continue
            del self._copies[name]
            self._copies_told[name] = copy.value
            register = copy.register.format(name=name)
            message = (
                f"{name} (a {type(copy.value).__name__}: a copy of the model's weights kept "
                "apart from it, changed by the run: a target network, an EMA kept by hand, "
                "the best weights so far) "
                "is not checkpointed: a resumed run would start it again as the script "
                "made it, whatever the run did to it since. Register it: "
                f"session.start({register}), and take it back from start.values if it is "
                "no module"
            )
            self.notes.append(f"cannot resume exactly: {message}")
            warn(message)
        self._watch_copies(where, variables)  # those made since (airbench's lookahead)
        for name, kept in rebound.items():
            if name in self._copies:
                self._copies[name].kept = kept

    def check_saves_left_behind(self) -> None:
        """As a run without the checkpoint optimization starts afresh: `save` wrote
        checkpoints into this run folder before (a script that ported its own snapshot
        every few epochs to ``session.save()``), which nothing resumes from. The same
        command started over from step 0 with no word, where the script's own snapshot
        had resumed it."""
        if self.checkpointing or not self.runs_a_script or self.state.run_dir is None:
            return
        folder = self.state.run_dir / "checkpoints"
        try:
            newest = optimization_class("checkpoint").newest_in(folder)
        except (OSError, RuntimeError) as error:  # a damaged manifest (CheckpointError)
            newest = f"? ({error})"
        if newest is None:
            return
        self._note(
            f"{folder} holds checkpoints (the newest at step {newest}, as session.save() "
            "writes them), but this run starts afresh at step 0: only the checkpoint "
            "optimization resumes from them at start(). To go on from the newest: "
            "Session([overlapkit.get_optimization('checkpoint')(...)], run_dir=...), or "
            f"session.load('{folder}') before start()"
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly, under one key per component."""
        self._check_copies_changed()
        state = self.state
        out: dict[str, Any] = {
            "progress": self.progress(),
            "rng": capture_rng(),
            "precision": self.precision.state_dict(),
            "optimizations": self.scheduler.state_dict(),
            "user": {name: obj.state_dict() for name, obj in self._stateful.items()},
            "values": self._values.state_dict(),
        }
        if self._raw_model is not None:
            out["model"] = self._raw_model.state_dict()
        for key in ("optimizer", "lr_scheduler", "loader"):
            component = getattr(state, key)
            if _sharded_optimizer(component):
                out["optimizer_shard"] = _ShardState(component).state_dict()
            elif component is not None and hasattr(component, "state_dict"):
                out[key] = component.state_dict()
        return out

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        state = self.state
        if self._raw_model is not None and "model" in saved:
            self._raw_model.load_state_dict(saved["model"])
        for key in ("optimizer", "lr_scheduler", "loader"):
            component = getattr(state, key)
            if key in saved and component is not None:
                component.load_state_dict(saved[key])
        if "optimizer_shard" in saved:
            if _sharded_optimizer(state.optimizer):
                _ShardState(state.optimizer).load_state_dict(saved["optimizer_shard"])
            elif state.optimizer is not None:  # (llm.c's --zero_stage changed)
                self._note(
                    "cannot resume exactly: the checkpoint holds a ZeroRedundancyOptimizer's "
                    f"shards, and this run's optimizer is a {type(state.optimizer).__name__}: "
                    "its state (momentum...) starts afresh"
                )
        self.precision.load_state_dict(saved.get("precision", {}))
        self.scheduler.load_state_dict(saved.get("optimizations", {}))
        self._loaded_user = dict(saved.get("user", {}))
        for name, obj in self._stateful.items():
            if name in self._loaded_user:
                obj.load_state_dict(self._loaded_user[name])
        self._values.load_state_dict(saved.get("values", {}))
        self.resume_progress(saved["progress"])
        if "loader" not in saved and isinstance(state.loader, SequenceLoader):
            # Saved before a list had a position: at an epoch's start, the run's epoch.
            state.loader.epoch = int(saved["progress"]["epoch"])
        restore_rng(saved["rng"])
        if state.step > 0:
            # The run's optimizers stepped before the checkpoint. torch's LR schedules
            # look at this process's calls only (their flag): a script stepping its
            # schedule first thing after the resume got a false "lr_scheduler.step()
            # before optimizer.step()" warning.
            for optimizer in (state.optimizer, *state.other_optimizers):
                if optimizer is not None:
                    optimizer._opt_called = True

    def save(self, directory: str | Path | None = None) -> Path:
        """Checkpoint now, in the checkpoint optimization's format and folder: the
        optimization's own folder by default (``run_dir/checkpoints`` without it), or
        ``directory``. Durable when it returns; call it on every rank. Returns the
        checkpoint's step folder.

        Inside a step, after its optimizer step (a script saving every N updates in
        its loop body), the checkpoint is the step's end: a resume goes on with the
        next step. Before it (the step's batch fetched, or its gradients accumulated
        but not applied), a resume cannot be exact: a `LoopWarning` says so. Without
        an optimizer (the script updates the parameters itself, after its forward), a
        step whose training forward ran is taken as trained."""
        self._every_rank_saves()
        state = self.state
        trained = self._in_step and not state.update_pending
        if trained and self._forwards_in_step > 0:
            # The step's batch is trained and applied: saved as after the step, as the
            # checkpoint at the next step's start would be (labelled one step early, a
            # resume ran that step's batch count again: one step more in steps(n)).
            with temporarily(state, "step", state.step + 1):
                saved = self._save(directory)
        elif self._in_step:
            self._warn_save_inside_update()
            return self._save(directory)
        else:
            saved = self._save(directory)
        self._rng_at_save = (saved, capture_rng())  # a step's end: looked at as the next starts
        return saved

    def check_draws_since_save(self) -> None:
        """As a step starts after `save`: the script's code between them drew random
        numbers (an evaluation after the save, its dropout left on, or a pass over a
        DataLoader, which draws its workers' seed from torch's RNG), which a resume
        from that checkpoint does not draw again if it ran after the save in the same
        epoch: the resumed run parted from the one never stopped, silently
        (minGPT-ddp's trainer saves, then evaluates)."""
        if self._rng_at_save is None:
            return
        (saved, rng), self._rng_at_save = self._rng_at_save, None
        kind = "followed by draws"
        if kind in self._save_warned or same_rng(rng, capture_rng()):
            return
        self._save_warned.add(kind)
        message = (
            f"the script drew random numbers between session.save() ({saved.name}) and the "
            "next step: code after the save in the loop's body (an evaluation with dropout "
            "left on, or any pass over a DataLoader, which draws its workers' seed from "
            "torch's RNG) does not run again in a resume from that checkpoint, which so "
            "parts from this run. Save after it, just before the next batch"
        )
        if self._epoch_batches == 0:  # a new pass: the draws may be the epoch loop's own
            self._note(
                f"{message}; draws at the top of the epoch loop, which a resume makes "
                "again, are no matter"
            )
            return
        self.notes.append(f"cannot resume exactly: {message}")
        warn(message)

    def meet_for_saves_from(self, store: Any) -> None:
        """Name this session's save meetings on the process group's store, which outlives
        a session (a second one in the same group, a group started again, a worker that
        torchrun restarted): with the first session's names a later one found its first
        meetings already held and saved on one rank alone. Every rank takes one number;
        the ranks' sessions in the same order get the same name."""
        taken = store.add("overlapkit/save/sessions", 1)
        self._save_meetings = f"overlapkit/save/{(taken - 1) // self.world.world_size}"

    def _every_rank_saves(self) -> None:
        """The ranks meet on the process group's store before saving: a script that
        calls `save` on one rank only (``if rank == 0: session.save()``, where it had
        its own ``torch.save``) left that rank waiting for the others in the save's
        collectives for good, silently. A rank that has waited `SAVE_WAIT_TOLD_S`
        says for which ranks; past the store's timeout it is an error."""
        world = self.world
        if world.world_size == 1:
            return
        store = dist.distributed_c10d._get_default_store()
        if self._save_meetings is None:  # this session's among those the store has seen
            self.meet_for_saves_from(store)
        self._saves += 1
        keys = [f"{self._save_meetings}/{self._saves}/{rank}" for rank in range(world.world_size)]
        store.set(keys[world.rank], str(self.state.step))
        if self._saves > 2:  # meeting n-2 is over for every rank: n-1 may still be polled
            with contextlib.suppress(RuntimeError, NotImplementedError):
                store.delete_key(f"{self._save_meetings}/{self._saves - 2}/{world.rank}")
        start, told = time.monotonic(), False
        while not store.check(keys):
            waited = time.monotonic() - start
            if waited >= (store.timeout.total_seconds() if told else SAVE_WAIT_TOLD_S):
                missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
                message = (
                    f"session.save() on rank {world.rank} (in step {self.state.step}) has "
                    f"waited {waited:.0f} s for rank(s) {missing} to call it too: every rank "
                    "calls it (each writes its own part, and they agree on the checkpoint). "
                    "A script that saves on one rank only (if rank == 0: session.save(), "
                    "where it had its own torch.save) waits here for good"
                )
                if told:
                    raise RuntimeError(message)
                told = True
                warn(message)
            time.sleep(min(0.05, 0.001 + waited / 10))

    def _warn_save_inside_update(self) -> None:
        state = self.state
        if state.update_pending:
            kind = "inside an update"
            why = (
                "between a forward and its optimizer step: the gradients accumulated since "
                "the last optimizer step are not saved"
            )
        else:
            kind = "before the step's forward"
            why = (
                "before its forward: its batch, already taken from the loader, would be "
                "skipped by a resume"
            )
        if kind in self._save_warned:
            return
        self._save_warned.add(kind)
        message = (
            f"session.save() in step {state.step} falls {why}, so a resume from it cannot be "
            "exact. Save after optimizer.step() (a script saving every N updates: on the "
            "batch that updates, not on every batch while its count stays at N)"
        )
        self.notes.append(f"cannot resume exactly: {message}")
        warn(message)

    def _save(self, directory: str | Path | None) -> Path:
        checkpointer = optimization_class("checkpoint")
        own = self.checkpoint
        if (
            own is not None
            and self._started
            and (directory is None or Path(directory).resolve() == own.root.resolve())
        ):
            return own.save_now(self.state)
        if directory is None:
            if self.state.run_dir is None:
                raise ValueError("session.save() needs a folder: Session(run_dir=...) or save(dir)")
            directory = self.state.run_dir / "checkpoints"
        return checkpointer.save_to(self.state, Path(directory))

    def load(self, directory: str | Path) -> Start:
        """Restore the newest intact checkpoint in ``directory`` (a folder written by
        `save` or by the checkpoint optimization), or the one step folder
        (``.../step-00000120``) given. Returns where the run continues."""
        path = optimization_class("checkpoint").load_from(self.state, Path(directory))
        self.state.resumed_from = str(path)
        where = self._where()
        self._watch_resumed_batch(where)
        if self.world.is_main:
            note(where.describe())
        return where


class _DictState:
    """A plain dict registered for checkpointing: restored in place."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values

    def state_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values.clear()
        self.values.update(state)


class _ShardState:
    """A ZeroRedundancyOptimizer's state as each rank holds it, its own shard: its
    state_dict() raised unless consolidated onto that rank first (every checkpoint of
    llm.c's --zero_stage 1 failed). Each rank saves and restores its own."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.optim.state_dict()

    def load_state_dict(self, shard: dict[str, Any]) -> None:
        self.optimizer.optim.load_state_dict(shard)
        outer, local = self.optimizer.param_groups, self.optimizer.optim.param_groups
        for group, saved in zip(outer, local, strict=True):
            # The hyperparameters (lr...) as saved, outside the shard too.
            group.update({k: v for k, v in saved.items() if k != "params"})


def _sharded_optimizer(optimizer: Any) -> bool:
    """A ZeroRedundancyOptimizer (each rank holds its shard of the state). Its module
    is not imported here (half a second at every start): a script using one has."""
    module = sys.modules.get("torch.distributed.optim")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)
