"""``checkpoint``: CheckFreq-style two-phase checkpointing, pipelined with training.

At the start of a step the state is exactly "after the previous step": the
snapshot is taken there (phase one, see `snapshot`) and overlaps the step's
data loading, forward and backward; the step waits for it just before its
optimizer step. A background thread then persists it (phase two, see
`persister`) while the following steps run.
"""

from __future__ import annotations

import os
import shutil
import textwrap
from collections import deque
from functools import partial
from pathlib import Path
from time import perf_counter
from typing import Any

from ...folders import LOCK, claim, nearest_existing, stamped
from ...runtime import (
    CombinationError,
    Demand,
    Knob,
    KnobError,
    Optimization,
    Resource,
    State,
    register_optimization,
)
from ...runtime.distributed import all_gather_objects
from ...runtime.optimization import number_in
from ...runtime.script import warn
from ...runtime.timing import Marks
from .coordination import Collectives, Domains, probe_domains
from .persister import Persister, split_state
from .policy import AutoInterval, CheckpointCost
from .restore import check_rank_count, load, newest_common_step, valid_steps
from .setup import setup_changes
from .snapshot import Snapshot, Snapshotter, tensor_layout
from .store import (
    MANIFEST,
    CheckpointError,
    Manifest,
    checkpoint_folder,
    fresh_flags,
    step_dir,
)

# In auto mode the ranks agree on when to checkpoint by a vote cast this many
# steps ahead, so that the training thread never waits for it.
VOTE_AHEAD = 2


STARVED = (
    "checkpoint due by step %d not taken: in the step before, a training forward of "
    "the prepared model ran after its optimizer step and nothing stepped after it, so "
    "the boundary falls inside an update, where a checkpoint could not resume exactly "
    "(none is taken until one does not). A second model's optimizer stepping after the "
    "prepared one's (a GAN's generator step runs the prepared discriminator)? Register "
    "it: session.start(optimizerG=optimizerG)"
)


@register_optimization
class Checkpoint(Optimization):
    """Two-phase checkpoints (snapshot, then persist) overlapped with training."""

    name = "checkpoint"
    key_figures = {
        "checkpoints": ("checkpoints",),
        "stall per checkpoint s": ("stall_s_mean",),
        "persist s": ("persist_s_mean",),
    }
    knobs = (
        Knob(
            name="every",
            type=int,
            default=100,
            low=1,
            high=1_000_000,
            log=True,
            intensity=(1000, 1),
            help="steps between checkpoints; 'auto': CheckFreq's policy",
        ),
        Knob(name="auto", type=bool, default=False, help="choose the interval (every: auto)"),
        Knob(
            name="max_overhead",
            type=float,
            default=0.035,
            low=0.001,
            high=0.5,
            needs="auto",
            help="auto mode's bound on the overhead",
        ),
        Knob(name="keep", type=int, default=2, low=1, high=10_000, help="checkpoints kept"),
        Knob(name="dir", type=str, default="checkpoints", help="relative to the run folder"),
        Knob(name="max_in_flight", type=int, default=1, low=1, high=4, help="persists at once"),
        Knob(name="on_error", type=str, default="stop", choices=("stop", "continue")),
        Knob(
            name="persist_nice",
            type=int,
            default=10,
            low=0,
            high=19,
            help="CPU priority of the persist thread: higher yields more to training",
        ),
        Knob(name="resume", type=bool, default=True, help="resume from the newest valid one"),
        Knob(name="final", type=bool, default=True, help="also checkpoint at the end"),
    )
    resources = frozenset({Resource.D2H, Resource.DISK, Resource.HOST_CPU})
    engines = {"tensorflow": "overlapkit.optimizations.checkpoint.tensorflow"}

    @classmethod
    def resolve(cls, intensity: float, explicit: dict[str, Any]) -> dict[str, Any]:
        explicit = dict(explicit)
        every = explicit.get("every")
        if isinstance(every, str) and every.strip().lower() == "auto":  # YAML's auto mode
            del explicit["every"]
            explicit["auto"] = True
        elif isinstance(every, str) and isinstance(number_in(every), str):
            raise KnobError("every", f"every must be a number of steps or auto, got {every!r}")
        return super().resolve(intensity, explicit)

    def __init__(self, intensity: float = 1.0, **explicit: Any) -> None:
        super().__init__(intensity, **explicit)
        self.root: Path | None = None
        self.policy_auto = (
            AutoInterval(self.settings["max_overhead"]) if self.settings["auto"] else None
        )
        self._snapshotter: Snapshotter | None = None
        self._persister: Persister | None = None
        self._domains: Domains | None = None
        self._reserved = False
        self._collectives: Collectives | None = None
        self._pending: Snapshot | None = None
        self._last_step = -1
        self._owed = False  # a checkpoint came due inside an update: take it at the next boundary
        self._deferred = 0  # checkpoints that came due inside an update
        self._told_starved = False
        self._updated = False  # an optimizer step since the step began
        self._step_started = 0.0
        self._cost = CheckpointCost()
        # Each step's time for the cost, as marks (on a GPU: CUDA events, so that it is
        # the device's time, read a few steps later): the step under way (its start,
        # measured, busy as it started, a checkpoint started at it), then the steps
        # ended whose times are not read yet.
        self._under_way: tuple[Any, bool, bool, bool] | None = None
        self._ended: deque[tuple[Any, Any, bool, bool, bool]] = deque()
        # Each checkpoint's stalls, as marks (on a GPU: CUDA events, so that a stall is
        # the time the device waited, read later): its snapshot and its wait before the
        # optimizer step, whether or not an earlier checkpoint is still being persisted.
        self._marks = Marks()
        self._stall_records: list[list[tuple[Any, Any]]] = []
        self._persists_seen = 0
        self.resumed_from: int | None = None
        self.errors: list[str] = []

    # ---------------------------------------------------------------- set-up
    def on_fit_start(self, state: State) -> None:
        self._open(
            state, self.folder_in(state.run_dir if state.run_dir is not None else Path.cwd())
        )
        world = state.world
        if self.settings["resume"]:
            self._resume(state)
        manifest, steps = (self.root / MANIFEST).exists(), any(self.root.glob("step-*"))
        if self._domains.leader(world.rank) and (
            (manifest or steps) if not self.settings["resume"] else (steps and not manifest)
        ):
            aside = self._move_aside()
            if self.settings["resume"]:  # nothing says which are complete, nor checks them
                warn(
                    f"{self.root} holds step folders but no {MANIFEST} (deleted, or the run "
                    "was killed before its first checkpoint was complete): without it they "
                    f"cannot be checked or resumed, so this run starts over; they are kept "
                    f"in {aside}"
                )
        all_gather_objects(None, world)  # no rank writes into a folder being moved away
        self._make_root()
        self._start_writers(state)

    def _move_aside(self) -> Path:
        """Keep the old checkpoints (a manifest lost or not) out of a fresh start's way, in
        a folder beside; the launcher's lock on a checkpoint.dir of its own (see `held`)
        stays."""
        aside = claim(stamped(self.root.parent, f"{self.root.name}.old"))
        # The manifest first: cut short, the folder holds no manifest naming what left.
        entries = sorted(self.root.iterdir(), key=lambda entry: entry.name != MANIFEST)
        for entry in entries:
            if entry.name == LOCK or entry.name.startswith(".probe-"):  # (the ranks' own)
                continue
            try:
                shutil.move(str(entry), str(aside / entry.name))
            except FileNotFoundError:  # gone since it was listed
                pass
        return aside

    def _open(self, state: State, root: Path) -> None:
        self.root = root
        self._make_root()
        # Collectives, in the same order on every rank: which ranks share a disk, the
        # checkpoint's own groups (then the resume).
        self._domains = probe_domains(self.root, state.world, state.replicated_shard.name)
        self._collectives = Collectives(state.world)

    def _start_writers(self, state: State) -> None:
        world = state.world
        self._marks = Marks(world.device)
        self._snapshotter = Snapshotter(
            world.device, self.settings["max_in_flight"], join=partial(state.policy.join, "persist")
        )
        self._persister = Persister(
            self.root,
            world.rank,
            world.world_size,
            self.settings["keep"],
            state.policy,
            shard=state.replicated_shard,
            domains=self._domains,
            collectives=self._collectives,
            nice=self.settings["persist_nice"],
            setup=state.setup,
        )
        self._last_step = state.step

    def check(self, world_size: int, device: str, backend: str) -> None:
        super().check(world_size, device, backend)
        configured = Path(self.settings["dir"]).expanduser()
        if configured.is_absolute():  # a relative one waits for the run folder
            _check_folder(configured, writable=self._must_write)

    @property
    def _must_write(self) -> bool:
        """Whether a folder this run cannot write to is refused before it starts: with
        on_error: continue a run trains on when its checkpoints fail (and resumes from
        those a read-only folder holds)."""
        return self.settings["on_error"] == "stop"

    def check_run_folder(self, run_dir: Path, world_size: int) -> None:
        root = self.folder_in(run_dir)
        # One inside the run folder is as writable as it: --out names that one.
        inside = root.resolve().is_relative_to(run_dir.resolve())
        _check_folder(root, writable=not inside and self._must_write)
        if run_dir.resolve().is_relative_to(root.resolve()):
            what = "is the run folder" if root.resolve() == run_dir.resolve() else "holds it"
            raise CombinationError(
                f"checkpoint.dir {self.settings['dir']} ({root}) {what}: a fresh start moves "
                "the checkpoint folder's contents aside, the run's own files with them. Name "
                "a folder of its own (the default: checkpoints, inside the run folder)"
            )
        if self.settings["resume"]:
            again = fresh_flags(run_dir, self.settings["dir"])
            start_over = (
                f"start over with overlapkit run {again} (the old checkpoints are kept aside)"
            )
            check_rank_count(root, world_size, start_over, error=CombinationError)

    def resumes_at(self, run_dir: Path) -> int | None:
        if not self.settings["resume"]:
            return None
        steps = [entry["step"] for entry in Manifest(self.folder_in(run_dir)).read()]
        return max(steps) if steps else None

    def saved_setup(self, run_dir: Path) -> dict[str, Any] | None:
        return Manifest(self.folder_in(run_dir)).setup()

    def folder_in(self, run_dir: Path) -> Path:
        """The checkpoint folder: ``dir`` as set, under ``run_dir`` unless absolute."""
        return checkpoint_folder(run_dir, self.settings["dir"])

    def cpu_demands(self, state: State) -> list[Demand]:
        # The persist thread (and, on a CPU, each snapshot's background copy).
        return [Demand("persist", 1, self.name)] if self._persister is not None else []

    def _make_root(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise CheckpointError(
                f"cannot create the checkpoint folder {self.root}: {error}"
            ) from None

    def _resume(self, state: State) -> None:
        # A collective: every rank takes part, whatever it finds on disk.
        step = newest_common_step(self.root, state.world, state.replicated_shard)
        if step is None:
            return
        recorded = Manifest(self.root).setup()
        if None not in (recorded, state.setup) and (
            changes := setup_changes(recorded, state.setup)
        ):
            again = fresh_flags(state.run_dir or Path.cwd(), self.settings["dir"])
            raise CheckpointError(
                f"{self.root} holds checkpoints of another setup ({'; '.join(changes)}): "
                "resuming would load them into a different model, optimizer or data order. "
                f"Start over with overlapkit run {again} (the old checkpoints are kept aside) "
                "or use another checkpoint folder"
            )
        saved = load(self.root, step, state.world.rank, state.replicated_shard)
        try:
            state.restore(saved)
        except (RuntimeError, ValueError) as error:
            if not str(error).startswith(DOES_NOT_FIT):
                raise  # memory, a lost peer, a loader's or a script's own object's say
            said = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
            raise CheckpointError(
                f"the checkpoint at step {step} in {self.root} does not fit this run "
                f"(checkpoints of another model or optimizer?): "
                f"{textwrap.shorten(said, 400, placeholder=' ...').rstrip('.')}. Start over "
                "with checkpoint resume: false, or use another checkpoint folder"
            ) from None
        self.resumed_from = step
        state.resumed_from = str(step_dir(self.root, step))

    # ------------------------------------- on request (Session.save / load)
    def save_now(self, state: State) -> Path:
        """Checkpoint the current state now, durable on return (every rank calls it)."""
        self._drop_pending()  # taken at this step's start: the state moved on since
        snapshot = self._snapshotter.take(state.step, self._capture(state), set())
        snapshot.wait()
        self._submit(snapshot)
        self._persister.drain()
        self._raise_if_failed()
        self._last_step = state.step
        return step_dir(self.root, state.step)

    def _drop_pending(self) -> None:
        """Discard the snapshot waiting for its step's optimizer step, freeing its buffers."""
        if self._pending is not None:
            self._pending.wait()
            self._pending.buffers.free.set()
            self._pending = None

    def newest_step(self) -> int | None:
        """The step of the newest complete checkpoint (None: none yet)."""
        return self.newest_in(self.root) if self.root is not None else None

    @classmethod
    def save_to(cls, state: State, root: Path) -> Path:
        """A checkpoint of the current state in ``root``, outside any run of this
        optimization (what `Session.save` writes into a folder of its choice)."""
        writer = cls(dir=str(root.resolve()), resume=False, final=False)
        writer._open(state, root.resolve())
        writer._start_writers(state)
        try:
            return writer.save_now(state)
        finally:
            writer._persister.close()
            writer._collectives.close()

    @staticmethod
    def newest_in(root: Path) -> int | None:
        """The step of the newest checkpoint the manifest in ``root`` lists (None: none)."""
        entries = Manifest(root).read()
        return entries[-1]["step"] if entries else None

    @staticmethod
    def load_from(state: State, root: Path) -> Path:
        """Restore the newest intact checkpoint in ``root``, or the step folder given."""
        step = None
        if not (root / MANIFEST).exists() and root.name.startswith("step-"):
            root, step = root.parent, int(root.name.removeprefix("step-"))
        if not (root / MANIFEST).exists():
            raise CheckpointError(
                f"no checkpoint in {root}: it has no {MANIFEST} (session.save() and the "
                "checkpoint optimization write one, beside step-NNNNNNNN folders)"
            )
        shard = state.replicated_shard
        if step is None:
            step = newest_common_step(root, state.world, shard)
        elif step not in valid_steps(root, state.world.rank, state.world.world_size, shard):
            listed = [entry["step"] for entry in Manifest(root).read()]
            if step not in listed:
                held = ", ".join(map(str, listed)) or "none"
                raise CheckpointError(
                    f"no checkpoint at step {step} in {root}: its manifest lists step(s) "
                    f"{held} (older ones are removed: keep)"
                )
            raise CheckpointError(f"the checkpoint at step {step} in {root} is not intact")
        if step is None:
            raise CheckpointError(f"no intact checkpoint in {root}")
        state.restore(load(root, step, state.world.rank, shard))
        return step_dir(root, step)

    # ----------------------------------------------------------------- hooks
    def on_step_start(self, state: State) -> None:
        self._raise_if_failed()
        now = perf_counter()
        self._observe_previous_step(now)
        self._step_started = now
        mark = self._marks.mark()
        self._time_steps(mark)
        busy = self._persister is not None and self._persister.in_flight > 0
        self._under_way = (mark, not state.is_warmup, busy, False)
        updated, self._updated = self._updated, False
        due = self._due(state)
        if not (due or self._owed):
            return
        if state.update_pending:
            # The step boundary falls inside an update (the script accumulates batches
            # itself, or fetched this batch before its update): taken at the first one
            # that follows an optimizer step instead.
            if updated and not self._told_starved and not state.fetches_ahead:
                # An update ended in the step before, and a training forward followed it:
                # not a loop accumulating batches (its boundaries clear at each update).
                self._told_starved = True
                warn(STARVED % state.step)
            self._owed = True
            self._deferred += due
            return
        self._owed = False
        begin, measured, busy, _ = self._under_way
        self._under_way = (begin, measured, busy, True)
        if self.policy_auto is not None:
            self.policy_auto.checkpoint_started()
        with state.clock.phase("ckpt_stall"):
            start = self._marks.mark()
            if state.optimizer is None:
                # The script updates the parameters itself (no optimizer step to wait
                # for): copy everything now, and persist it at once.
                snapshot = self._snapshotter.take(state.step, self._capture(state), set())
                snapshot.wait()
                self._submit(snapshot)
            else:
                deferrable = _deferrable_storages(state)
                self._pending = self._snapshotter.take(state.step, self._capture(state), deferrable)
            self._stall_records.append([(start, self._marks.mark())])
        self._last_step = state.step

    def on_before_optimizer_step(self, state: State) -> None:
        self._updated = True
        if self._pending is None:
            return
        # The only moment the saved state changes: the snapshot must be complete (on a
        # GPU the optimizer's kernels wait for the copy stream; the host goes on).
        with state.clock.phase("ckpt_stall"):
            start = self._marks.mark()
            self._pending.wait_on_device()
            self._stall_records[-1].append((start, self._marks.mark()))
        self._submit(self._pending)
        self._pending = None

    def on_step_end(self, state: State) -> None:
        if not self._reserved and state.optimizer is not None:
            # After the first optimizer step its state exists: every buffer's shape is known.
            self._reserved = True
            self._snapshotter.reserve(tensor_layout(self._capture(state)))

    def on_fit_end(self, state: State) -> None:
        if self._persister is None:
            return
        # The last step's time is not fed to the auto policy: up to here it holds what
        # follows the steps (an evaluation at the end, the script's own code).
        # A snapshot taken at the start of a step that never ran (a script's epoch end).
        pending = self._pending
        if self._deferred:
            self.errors.append(
                f"{self._deferred} checkpoint(s) came due inside an update (a step boundary "
                "between a forward and its optimizer step: the script accumulates batches "
                "itself, fetches its next batch before it updates, steps a second "
                "optimizer it did not register, or its GradScaler skipped the optimizer "
                "step for inf/NaN gradients) and waited for the next boundary after an "
                "optimizer step" + ("; none came, so none was taken" if self._owed else "")
            )
        inside = state.update_pending  # the loop ended between a forward and its update
        # A loop fetching its next batch before it updates (nanoGPT's) ends holding a
        # batch it never trained: a final checkpoint after it, resumed, lost that batch.
        ahead = state.fetches_ahead and not inside
        if inside and self.settings["final"]:
            self.errors.append("no final checkpoint: the loop ended inside an update")
        elif ahead and self.settings["final"]:
            self.errors.append(
                "no final checkpoint: the loop fetches its next batch before it updates, so "
                "it ended holding a batch it never trained, which a resume would skip"
            )
        final = self.settings["final"] and not inside and not ahead
        if final and (state.step != self._last_step or pending is not None):
            self._drop_pending()  # the state moved on since: the final one replaces it
            snapshot = self._snapshotter.take(state.step, self._capture(state), set())
            snapshot.wait()
            self._submit(snapshot)
            self._last_step = state.step
        elif pending is not None:
            self._pending = None
            self._submit(pending)
        self._persister.close()
        self._collectives.close()
        if self.policy_auto is not None:  # a checkpoint whose persist outlasted the run
            self._feed_persists()
            self.policy_auto.finish()
        self._raise_if_failed()

    # --------------------------------------------------------------- helpers
    def _due(self, state: State) -> bool:
        since = state.step - self._last_step
        if since <= 0:
            return False
        if self.policy_auto is None:
            return state.step % self.settings["every"] == 0
        # Each rank measures its own steps: the ranks vote, VOTE_AHEAD steps ahead, and
        # checkpoint together when any rank finds one due.
        ahead = state.step + VOTE_AHEAD
        self._collectives.cast_vote(ahead, state.step, self.policy_auto.due(since + VOTE_AHEAD))
        agreed = self._collectives.agreed(state.step)
        # A vote cast before the last checkpoint started counted from that one.
        return agreed is not None and agreed[0] and agreed[1] > self._last_step

    def _capture(self, state: State) -> dict[str, Any]:
        """The state to checkpoint; the replicated part only on its writers (one per
        storage domain)."""
        tree = state.capture()
        if not self._domains.writes_shard(state.world.rank):
            _, tree = split_state(tree)
        return tree

    def _submit(self, snapshot: Snapshot) -> None:
        self._persister.submit(snapshot)

    def _observe_previous_step(self, now: float) -> None:
        """Feed the auto policy the last step's time and finished persists."""
        if self._step_started == 0.0 or self.policy_auto is None:
            return
        self.policy_auto.record_step(now - self._step_started)
        self._feed_persists()

    def _time_steps(self, now: Any, wait: bool = False) -> None:
        """A step starts at mark ``now``: the one under way ended there. Record the
        ended steps whose marks can be read (all of them, ``wait``ing for the device,
        at the end) for the cost of a checkpoint (`CheckpointCost`), in order."""
        if self._under_way is not None and now is not None:
            begin, measured, busy, starts = self._under_way
            self._ended.append((begin, now, measured, busy, starts))
        while self._ended and (wait or self._marks.ready(self._ended[0][1])):
            begin, end, measured, busy, starts = self._ended.popleft()
            if measured:
                self._cost.record(self._marks.seconds(begin, end), starts, busy)
            self._marks.release(begin)  # (its end begins the next step: released then)

    def _feed_persists(self) -> None:
        persister = self._persister
        while persister and self._persists_seen < len(persister.persist_s):
            self.policy_auto.persist_finished(persister.persist_s[self._persists_seen])
            self._persists_seen += 1

    def _raise_if_failed(self) -> None:
        error = self._persister.error if self._persister else None
        if error is None:
            return
        message = f"persisting a checkpoint to {self.root} failed: {error}"
        if self.settings["on_error"] == "stop":
            raise CheckpointError(message + " (earlier checkpoints are intact)") from error
        if message not in self.errors:
            self.errors.append(message)  # training goes on without checkpoints

    # ---------------------------------------------------------------- results
    def state_dict(self) -> dict[str, Any]:
        auto = self.policy_auto
        return {"interval": auto.interval if auto else None}

    @property
    def stalls_s(self) -> list[float]:
        """Each checkpoint's stall: the time the steps waited for its snapshot."""
        seconds = self._marks.seconds
        return [sum(seconds(b, e) for b, e in spans) for spans in self._stall_records]

    def _cost_estimate(self) -> dict[str, Any]:
        self._time_steps(None, wait=True)  # the steps whose marks were not read yet
        return self._cost.estimate()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.policy_auto is not None and state.get("interval"):
            self.policy_auto.interval = int(state["interval"])

    def summary(self) -> dict[str, Any]:
        persister = self._persister
        stalls = self.stalls_s
        out = {
            **super().summary(),
            "dir": str(self.root),
            "checkpoints": len(persister.persist_s) if persister else 0,
            "resumed_from_step": self.resumed_from,
            "stall_s_mean": sum(stalls) / len(stalls) if stalls else 0.0,
            "snapshot_copy_s_mean": (
                sum(persister.copy_s) / len(persister.copy_s)
                if persister and persister.copy_s
                else 0.0
            ),
            "persist_s_mean": (
                sum(persister.persist_s) / len(persister.persist_s)
                if persister and persister.persist_s
                else 0.0
            ),
            **self._cost_estimate(),
            "bytes_written": persister.bytes_written if persister else 0,  # all ranks' files
            "host_buffer_bytes": self._snapshotter.buffer_bytes if self._snapshotter else 0,
            # Pinned on a GPU, as the host allocator holds it (0 on a CPU: nothing pinned).
            "pinned_bytes": self._snapshotter.held_bytes
            if self._snapshotter and self._snapshotter.sets[0].pin
            else 0,
            "notes": self.errors,
        }
        if self.policy_auto is not None:
            # The interval auto mode chose (the knob's own value, 1, is unused there).
            chosen = self.policy_auto.interval
            out["every"] = chosen if chosen is not None else "auto (none chosen yet)"
            out["auto_policy"] = {
                "interval": self.policy_auto.interval,
                "measured_overhead": self.policy_auto.overhead
                if self.policy_auto.history
                else None,
                "history": self.policy_auto.history,
            }
        return out


def _deferrable_storages(state: State) -> set[int] | None:
    """Storages that change only in optimizer.step(): parameters and optimizer state
    (or what the loop says, see `State.deferrable`); not the parameters another
    registered optimizer steps, maybe before this one (two optimizers over one model)."""
    if state.deferrable is not None:
        return state.deferrable()
    storages = {p.untyped_storage().data_ptr() for p in state.model.parameters()}
    if state.optimizer is not None:
        for per_param in state.optimizer.state.values():
            for value in per_param.values():
                if hasattr(value, "untyped_storage"):
                    storages.add(value.untyped_storage().data_ptr())
    for other in state.other_optimizers:
        for group in other.param_groups:
            storages -= {p.untyped_storage().data_ptr() for p in group["params"]}
    return storages


# How torch's load_state_dict says a checkpoint is of another model (missing keys,
# other shapes: RuntimeError) or another optimizer (its parameter groups: ValueError).
DOES_NOT_FIT = ("Error(s) in loading state_dict", "loaded state dict")


def _check_folder(root: Path, writable: bool = True) -> None:
    """Raise when ``root`` cannot be a folder: it, or a folder it would sit in, is a file
    (``..`` resolved first: ``run/../x`` is ``x``, though ``run`` does not exist yet), or
    (``writable``) the nearest that exists cannot be written (the run failed once its
    folder was made)."""
    place = nearest_existing(root)
    if place is None:
        return
    if not place.is_dir():
        raise CombinationError(f"checkpoint.dir {root}: {place} is a file; name a folder")
    if writable and not os.access(place, os.W_OK | os.X_OK):
        raise CombinationError(
            f"checkpoint.dir {root}: {place} cannot be written (read-only, or not "
            "yours); name a folder you can write to"
        )
