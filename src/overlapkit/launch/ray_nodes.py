"""One run on a Ray cluster: a placement group with a bundle per machine of the
scenario's world, one actor per machine that starts that machine's ranks with
overlapkit's own launcher (`overlapkit run --node-rank K --master HOST:PORT`,
rendezvous at the first actor), and every machine's run folder brought back to the
driver. Both ``overlapkit tune --ray`` (one run per trial) and ``overlapkit run
--ray`` use it.

A bundle per machine, not per rank: Ray hands GPUs to an actor, and the actor that
starts a machine's ranks must hold all of their GPUs so that Ray sets
``CUDA_VISIBLE_DEVICES`` to exactly those. One machine: ``STRICT_PACK``; several:
``STRICT_SPREAD`` (each bundle on a machine of its own).
"""

from __future__ import annotations

import atexit
import io
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..folders import LOCK
from ..runtime.checkpoint_folder import (
    CHUNK_BYTES,
    Fetch,
    finish_files,
    listed_files,
    manifest_text,
    read_chunk,
    write_chunk,
)
from ..runtime.checkpoint_mirrors import Mirrors
from .config import WorldConfig
from .interrupt import stop_if_asked
from .local import alive, die_with_parent

POLL_S = 0.5
GRPC_READY_S = 10.0  # how long a head's gRPC port may take to answer
START_ONE = (
    "start one with `ray start --head` or `ray up cluster/gcp-v100.yaml`, then pass its address"
)
# How long a run waits for room on the cluster (an autoscaler may have to start VMs
# first): `room_timeout_s`; and after how long it says that it waits.
ROOM_TIMEOUT = "OVERLAPKIT_RAY_ROOM_TIMEOUT_S"
ROOM_NOTICE_S = 10.0
ROOM_POLL_S = 1.0  # how often a run waiting for room looks whether it was placed
ROOM_CHECK_S = 2.0  # and asks the cluster whether its machines could hold it
STRAGGLER_S = 20.0  # after one machine's ranks fail, how long the others get to fail too
NODE_FOLDERS = "nodes"  # machine k > 0's run folder: <run folder>/nodes/node<k>
CHECKPOINTS = "checkpoints"  # the checkpoint optimization's folder in a run folder
PLUGINS = "OVERLAPKIT_PLUGINS"  # the plugin modules that name optimizations


class RayClusterError(RuntimeError):
    """No cluster to run on, or one that cannot hold the run."""


class RayRunFailed(RuntimeError):
    """The run on the cluster failed: a machine was lost, its ranks failed, or this
    machine could not take what the machines sent."""


class OutOfTime(RayClusterError):
    """The time given (tune's ``--timeout``: only tune gives one) ran out while the run
    waited for room."""


def room_timeout_s() -> float:
    """How long a run waits for room on the cluster: OVERLAPKIT_RAY_ROOM_TIMEOUT_S
    seconds (unset or empty: 900). Read when a run joins a cluster, not as the CLI
    imports (a value that is no number was a traceback from every command)."""
    text = os.environ.get(ROOM_TIMEOUT, "").strip() or "900"
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise RayClusterError(
            f"{ROOM_TIMEOUT} is {os.environ[ROOM_TIMEOUT]!r}: set it to the seconds a run "
            "waits for room on the cluster (above 0; default 900), or unset it"
        )
    return seconds


@dataclass
class RayOutcome:
    """How a run on the cluster ended: every machine's exit code (None: never ended),
    the stderr of the machine that failed first, or the machine that was lost."""

    returncodes: list[int | None] = field(default_factory=list)
    stderr: str = ""
    lost: str | None = None  # "node <ip> (<id>): <error>"
    lost_machine: int | None = None  # which machine of the run (k) was lost
    timed_out: bool = False
    stopped: bool = False  # on_lines asked to stop
    failed_on: str = ""  # "machine <k> of the run (<ip>)": the one whose stderr this is

    @property
    def ok(self) -> bool:
        ended = self.lost is None and not self.timed_out and not self.stopped
        return ended and all(c == 0 for c in self.returncodes)

    @property
    def returncode(self) -> int:
        return next((c for c in self.returncodes if c), 0) or 0


# ------------------------------------------------------------------ the driver
def connect(address: str | None) -> None:
    """Join the cluster at ``address`` ("auto": the one this machine belongs to)."""
    import ray

    room_timeout_s()  # a setting that cannot work, named before any wait
    if ray.is_initialized():
        return
    source = ""
    if not address or address == "auto":
        address, source = _address_here()
    _reachable(address, source)  # ray.init retries an unreachable address for minutes
    _cluster_errors_to_stderr()
    try:
        ray.init(
            address=address,
            namespace="overlapkit",
            log_to_driver=False,
            logging_level=logging.WARNING,
            configure_logging=False,
        )
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise RayClusterError(
            f"no Ray cluster at {address}{source} ({error}); {START_ONE}"
        ) from None
    # Leave the cluster before Ray's own exit hook, which first sleeps half a second
    # for worker logs to reach the driver (there are none: log_to_driver=False).
    atexit.register(ray.shutdown)


def _cluster_errors_to_stderr() -> None:
    """The errors the cluster publishes, one line each on stderr. Ray's driver prints
    them whole to stdout, where ``--json`` puts its document: a lost machine's raylet
    sent ~50 lines of its state dump there, ahead of the study's JSON. overlapkit
    says itself which machine was lost; the rest stays in Ray's logs on that machine
    (/tmp/ray/session_latest/logs)."""
    from ray._private import worker

    printer = getattr(worker, "print_to_stdstream", None)
    if printer is None or getattr(printer, "one_line", False):
        return

    def one_line(data: dict[str, Any], ignore_prefix: bool) -> None:
        if data.get("pid") != "raylet":
            printer(data, ignore_prefix)
            return
        for message in data.get("lines", []):
            first = next((line.strip() for line in str(message).splitlines() if line.strip()), "")
            if first:
                print(f"(ray) {first}", file=sys.stderr, flush=True)

    one_line.one_line = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = one_line


def _address_here() -> tuple[str, str]:
    """The cluster ``ray.init("auto")`` would join, and where its address comes from:
    RAY_ADDRESS, else the newest `ray start` on this machine (or a cluster running
    here). Checked like a given address: a stale RAY_ADDRESS was minutes of Ray's
    retries."""
    from ray._private.services import canonicalize_bootstrap_address

    named = os.environ.get("RAY_ADDRESS", "").strip()
    if named and named != "auto":
        return named, " (from RAY_ADDRESS)"
    try:
        found = canonicalize_bootstrap_address("auto")
    except (ConnectionError, ValueError):
        found = None
    if not found:
        raise RayClusterError(
            f"--ray: no Ray cluster on this machine (none started here, RAY_ADDRESS unset); "
            f"{START_ONE}"
        )
    return found, " (the newest `ray start` on this machine)"


def _reachable(address: str, source: str = "") -> None:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if "://" in host:  # http://HOST:8265, the dashboard's (and `ray job`'s) address
        raise RayClusterError(
            f"--ray takes HOST:PORT (the head's GCS address, port 6379 by default), not the "
            f"URL {address!r}{source}: the dashboard's, for `ray job submit`"
        )
    if not host or not port.isdigit():
        raise RayClusterError(
            f"--ray takes HOST:PORT (the head's GCS address), not {address!r}{source}"
        )
    try:
        # An IPv6 host comes bracketed ([fd00::1]:6379, as Ray writes it): not for sockets.
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except OSError as error:
        raise RayClusterError(
            f"no Ray cluster answers at {address}{source} ({error.strerror or error}); {START_ONE}"
        ) from None
    if os.environ.get("RAY_USE_TLS", "0") not in ("", "0"):
        return  # a TLS channel needs the cluster's certificates: ray.init checks
    import grpc  # Ray's own dependency: its GCS (and Ray Client server) speak gRPC
    from ray._private.ray_constants import GLOBAL_GRPC_OPTIONS  # as Ray connects (no proxy)

    channel = grpc.insecure_channel(f"{host}:{port}", options=GLOBAL_GRPC_OPTIONS)
    try:
        grpc.channel_ready_future(channel).result(timeout=GRPC_READY_S)
    except grpc.FutureTimeoutError:
        # Something else listens there (ray.init would retry it for minutes).
        raise RayClusterError(
            f"{address}{source} answers, but not as a Ray cluster (no gRPC server there): is it "
            f"the head's GCS port (6379 by default)? {START_ONE}"
        ) from None
    finally:
        channel.close()


def placed_world(world: WorldConfig) -> WorldConfig:
    """``world`` as the cluster runs it: "auto" device decided by the cluster (GPUs
    anywhere: cuda), not by the driver, which often has none; and ``threads`` (default
    1) set, since each rank holds that many of a machine's CPUs and must use no more."""
    import ray

    device = world.device
    if device == "auto":
        device = "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    return world.model_copy(update={"device": device, "threads": world.threads or 1})


def node_bundle(world: WorldConfig) -> dict[str, float]:
    """What one machine of a `placed_world` run holds: its ranks' CPUs (``threads``
    each) and, on cuda, a GPU per rank."""
    bundle = {"CPU": float(world.nprocs * (world.threads or 1))}
    if world.device == "cuda":
        bundle["GPU"] = float(world.nprocs)
    return bundle


def _live_machines() -> str:
    import ray
    from ray.exceptions import RayError

    try:
        alive = [n for n in ray.nodes() if n.get("Alive")]
    except (RayError, ConnectionError, TimeoutError):
        return "machines it did not name (it did not answer)"
    held = [{k: v for k, v in n.get("Resources", {}).items() if k in ("CPU", "GPU")} for n in alive]
    return f"{len(alive)} live machine(s): {held}"


def runs_that_fit(world: WorldConfig) -> int:
    """How many such runs the cluster's live machines hold at once (0: none now)."""
    import ray

    bundle = node_bundle(world)
    fits = []
    for node in ray.nodes():
        if node.get("Alive"):
            have = node.get("Resources", {})
            fits.append(min(int(have.get(k, 0) // v) for k, v in bundle.items() if v > 0))
    if world.nodes == 1:
        return sum(fits)
    # Each run needs `nodes` different machines: count rounds over the machines.
    runs, fits = 0, sorted(fits, reverse=True)
    while len([f for f in fits if f > 0]) >= world.nodes:
        fits = sorted((f - 1 if i < world.nodes else f for i, f in enumerate(fits)), reverse=True)
        runs += 1
    return runs


def run_on_ray(
    scenario_text: str,
    world: WorldConfig,
    run_dir: Path,
    *,
    run_args: list[str] | None = None,
    timeout_s: float | None = None,
    on_lines: Callable[[str], bool] | None = None,
    checkpoints: bool = True,
    resume: dict[int, Path] | None = None,
    placement_timeout_s: float | None = None,
    give_up_at: float | None = None,
) -> RayOutcome:
    """Run the scenario (YAML text, with the `placed_world` ``world``) over
    ``world.nodes`` machines of the cluster and
    bring each machine's run folder to ``run_dir`` (node 0's) and
    ``run_dir/nodes/node<k>``. ``on_lines(text)`` gets node 0's new live step records
    as they are written; returning True stops the run. ``checkpoints``: mirror each
    machine's checkpoints there as they are written (a run that fails, is stopped or
    loses its driver keeps what had reached it). ``resume``: machine k's folder of an
    earlier run, sent to it first. ``give_up_at`` (a `time.time()`): raise `OutOfTime`
    if the run still waits for room then."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if placement_timeout_s is None:
        placement_timeout_s = room_timeout_s()
    if give_up_at is not None and time.time() >= give_up_at:  # (Optuna starts one late)
        raise OutOfTime("its time (tune's --timeout) ran out before it started")
    bundle = node_bundle(world)
    strategy = "STRICT_PACK" if world.nodes == 1 else "STRICT_SPREAD"
    group = placement_group([bundle] * world.nodes, strategy=strategy)
    actors: list[Any] = []
    places: list[dict[str, Any]] = []
    lost: int | None = None  # the machine that was lost: nothing to stop there
    mirrors: Mirrors | None = None
    mirroring = False  # the machines' checkpoints on their way here
    kept = False  # the machines' folders kept (this machine could not take them)
    try:
        _wait_for_room(group, world, strategy, placement_timeout_s, give_up_at)
        runner = ray.remote(NodeRunner)
        for k in range(world.nodes):
            actors.append(
                runner.options(
                    max_concurrency=4,  # polls go on while checkpoint chunks travel
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=group, placement_group_bundle_index=k
                    ),
                ).remote()
            )
        from ray.exceptions import ActorUnavailableError, RayActorError

        try:
            places = ray.get([a.where.remote() for a in actors])
            master = f"{places[0]['ip']}:{places[0]['port']}"
            # Each machine's checkpoints go first, chunk by chunk; then the rest of its
            # folder with its start. Machine 0's folder holds the others' under nodes/:
            # not sent to it (they came back from it at the end, over newer mirrors).
            for k, folder in (resume or {}).items():
                _send_checkpoints(folder / CHECKPOINTS, actors[k])
            earlier = {
                k: pack(folder, skip=(NODE_FOLDERS, CHECKPOINTS, LOCK))
                for k, folder in (resume or {}).items()
            }
            plugins = os.environ.get(PLUGINS)  # the driver's, which checked the scenario
            ray.get(
                [
                    a.start.remote(
                        scenario_text,
                        k,
                        world.nodes,
                        master,
                        run_args or [],
                        earlier.get(k),
                        plugins,
                    )
                    for k, a in enumerate(actors)
                ]
            )
        except (RayActorError, ActorUnavailableError) as error:  # lost while starting
            return RayOutcome(lost=f"a machine was lost while the run started: {error}"[:600])
        mirroring = checkpoints  # until all they hold is here: this machine's disk may fill
        mirrors = _mirrors(actors, run_dir) if checkpoints else None
        outcome = _watch(actors, places, timeout_s, on_lines, mirrors)
        lost = outcome.lost_machine
        if mirrors is not None and not outcome.stopped:
            # What reached this machine stays whatever happened: a failed run resumes.
            if outcome.lost is None:
                try:
                    mirrors.update(ray.get([a.manifest.remote() for a in actors]))
                except (RayActorError, ActorUnavailableError):
                    pass  # a machine lost just now: the manifests seen before stand
            mirrors.finish(lost=lost)
        if outcome.lost is None and not outcome.stopped:
            _gather(actors, run_dir, mirrored=checkpoints)
        return outcome
    except OSError as error:
        from ray.exceptions import RayError

        # This machine's own file error (its disk full), not a machine's (a RayError)
        # nor the network's (a ConnectionError from Ray's transport).
        if not mirroring or isinstance(error, (RayError, ConnectionError, TimeoutError)):
            raise
        if mirrors is not None:
            mirrors.stop()  # before the folders move
        folders = _stop(actors, lost, keep=True)
        kept = True
        held = ", ".join(f"machine {k} ({places[k]['ip']}) at {f}" for k, f in folders.items() if f)
        raise RayRunFailed(
            f"this machine could not take the run's files from the machines ({error}); "
            + (
                f"each machine keeps its run folder until you remove it: {held}; copy each "
                f"one's run/ into {run_dir} (machine 0) or {run_dir / NODE_FOLDERS}/node<k>, "
                "then the same command (without --fresh) resumes from their checkpoints"
                if held
                else "no machine's run folder was left to keep"
            )
        ) from error
    finally:
        if mirrors is not None:
            mirrors.stop()  # an error or Ctrl-C: a copy under way is given up
        if not kept:
            _stop(actors, lost, keep=False)
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(group)


def _stop(actors: list[Any], lost: int | None, keep: bool) -> dict[int, str | None]:
    """Stop the ranks of every machine still there at once (not the lost one's: gone
    with it, and Ray takes seconds to say that its actor does not answer); their
    folders removed, or with ``keep`` kept where `NodeRunner.stop` says."""
    import ray

    stops = {k: a.stop.remote(keep) for k, a in enumerate(actors) if k != lost}
    kept: dict[int, str | None] = {}
    for k, stop in stops.items():
        try:
            kept[k] = ray.get(stop, timeout=30)
        except Exception:  # noqa: BLE001 - a machine lost since: nothing left to stop there
            kept[k] = None
    return kept


def _wait_for_room(
    group: Any, world: WorldConfig, strategy: str, timeout_s: float, give_up_at: float | None
) -> None:
    """Wait until ``group`` is placed. Only the time that the cluster's live machines
    could not hold the run even when idle counts against ``timeout_s`` (an autoscaler
    may be adding machines); a cluster that holds it but is busy (this study's other
    trials, other jobs) is waited for, until ``give_up_at``: a trial queued behind the
    study's own trials (``--max-concurrent`` above what the cluster holds) failed as
    "no room" and stopped the study. The cluster is asked what it holds every
    ``ROOM_CHECK_S``; a question it does not answer (the GCS restarting, say) leaves
    the last answer standing (none yet: it waits, and says nothing)."""
    import ray
    from ray.exceptions import RayError

    bundle = node_bundle(world)
    what = f"{world.nodes} machine(s) holding {bundle} each ({strategy})"
    started = checked = time.monotonic()
    short_since: float | None = None
    busy: bool | None = None  # whether idle machines would hold it (None: no answer yet)
    said: set[bool] = set()
    placed = group.ready()  # once: each call starts a task in the group
    while not ray.wait([placed], timeout=ROOM_POLL_S)[0]:
        stop_if_asked()
        if give_up_at is not None and time.time() >= give_up_at:
            raise OutOfTime(
                f"its time (tune's --timeout) ran out while it waited for room for {what}"
            )
        now = time.monotonic()
        if now - checked < ROOM_CHECK_S:
            continue
        try:
            busy = runs_that_fit(world) > 0
        except (RayError, ConnectionError, TimeoutError):
            pass  # no answer: the last one stands
        last, checked = checked, now
        if busy is None:
            continue
        short_since = None if busy else short_since or last
        if short_since is not None and now - short_since >= timeout_s:
            raise RayClusterError(
                f"the cluster found no room within {timeout_s:g} s for {what}; it has "
                f"{_live_machines()}: add machines, or ask for fewer (world.nodes, "
                "world.nprocs, world.threads)"
            )
        # Said after ROOM_NOTICE_S, or halfway to a shorter time-out (before giving up).
        if now - started < min(ROOM_NOTICE_S, timeout_s / 2) or busy in said:
            continue
        said.add(busy)
        why = (
            "its live machines hold it once the work on them ends (other trials or jobs)"
            if busy
            else f"it has {_live_machines()} (an autoscaler may add machines); giving up "
            f"after {timeout_s:g} s"
        )
        print(
            f"overlapkit: waiting for room on the cluster for {what}; {why}",
            file=sys.stderr,
            flush=True,
        )


def _watch(
    actors: list[Any],
    places: list[dict[str, Any]],
    timeout_s: float | None,
    on_lines: Callable[[str], bool] | None,
    mirrors: Mirrors | None = None,
) -> RayOutcome:
    import ray
    from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failed_at, offset = None, 0
    outcome = RayOutcome()
    while True:
        # Each actor answers when its ranks end or after POLL_S, whichever comes first.
        pending = [
            a.poll.remote(offset if k == 0 else None, POLL_S, mirrors is not None)
            for k, a in enumerate(actors)
        ]
        states: list[Any] = []
        for k, ref in enumerate(pending):
            try:
                states.append(ray.get(ref, timeout=120))
            except (RayActorError, ActorUnavailableError, GetTimeoutError) as error:
                place = places[k]
                first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
                outcome.lost = (
                    f"node {place['ip']} ({place['node_id'][:12]}, machine {k} of the run) "
                    f"was lost: {type(error).__name__}: {first_line[:300]}"
                )
                outcome.lost_machine = k
                return outcome
        stop_if_asked()  # tune was stopped (Ctrl-C): `run_on_ray` stops the ranks
        outcome.returncodes = [code for code, *_ in states]
        _, text, offset, _ = states[0]
        if mirrors is not None:
            mirrors.update([manifest for *_, manifest in states])
        if text and on_lines is not None and on_lines(text):
            outcome.stopped = True  # `finally` of run_on_ray stops the ranks
            return outcome
        codes = outcome.returncodes
        if all(c is not None for c in codes):
            break
        if failed_at is None and any(c for c in codes if c is not None):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > STRAGGLER_S:
            break  # the rest would wait for their lost peers until a time-out
        if deadline is not None and time.monotonic() > deadline:
            outcome.timed_out = True
            break
    failing = [k for k, c in enumerate(outcome.returncodes) if c]
    if failing:
        outcome.stderr = ray.get(actors[failing[0]].stderr.remote())
        outcome.failed_on = f"machine {failing[0]} of the run ({places[failing[0]]['ip']})"
    return outcome


def _mirrors(actors: list[Any], run_dir: Path) -> Mirrors:
    """On the driver, each machine's checkpoint folder as of its newest manifest."""
    import ray
    from ray.exceptions import RayError

    def fetcher(actor: Any) -> Fetch:
        def fetch(step: int, name: str, offset: int, size: int) -> bytes | None:
            # The actor answers polls meanwhile; a machine lost on the way raises.
            return ray.get(actor.checkpoint_chunk.remote(step, name, offset, size))

        return fetch

    roots = [machine_folder(run_dir, k) / CHECKPOINTS for k in range(len(actors))]
    return Mirrors([fetcher(a) for a in actors], roots, gone=(RayError,))


def _send_checkpoints(root: Path, actor: Any) -> None:
    """The checkpoints the manifest under ``root`` lists, to the machine of ``actor``
    (a resumed run's), a chunk at a time: two in flight, so that the network and
    the disks on both ends are busy together."""
    import ray

    text = manifest_text(root)
    if text is None:
        return
    in_flight: list[Any] = []
    for step, name, size in listed_files(text):
        for offset in range(0, size, CHUNK_BYTES) if size else [0]:
            data = read_chunk(root, step, name, offset, CHUNK_BYTES)
            if data is None or len(data) != min(CHUNK_BYTES, size - offset):
                raise RayClusterError(f"{root}'s step {step} lost its file {name} while sent")
            in_flight.append(actor.receive_chunk.remote(step, name, offset, data))
            del data
            if len(in_flight) >= 2:
                ray.get(in_flight.pop(0))
    ray.get(in_flight)
    ray.get(actor.receive_manifest.remote(text))


def _gather(actors: list[Any], run_dir: Path, mirrored: bool) -> None:
    """Every machine's run folder (its checkpoints apart: see `_mirrors`), with the
    summary's ``run_dir`` and checkpoint folder saying where they are now (not in the
    machine's temporary folder, removed by then); none, unless ``mirrored``."""
    import ray

    run_dir.mkdir(parents=True, exist_ok=True)
    archives = ray.get([a.collect.remote() for a in actors])
    for k, archive in enumerate(archives):
        folder = machine_folder(run_dir, k)
        unpack(archive, folder)
        summary = folder / "summary.json"
        if summary.is_file():
            document = json.loads(summary.read_text())
            there, document["run_dir"] = document.get("run_dir"), str(folder)
            checkpoint = (document.get("optimizations") or {}).get("checkpoint")
            held = checkpoint.get("dir") if isinstance(checkpoint, dict) else None
            if not mirrored and isinstance(checkpoint, dict):  # a tune trial's
                checkpoint["dir"] = None
                checkpoint.setdefault("notes", []).append(
                    "its checkpoints stayed on the machines (not mirrored), removed there"
                )
            elif there and isinstance(held, str) and Path(held).is_relative_to(there):
                checkpoint["dir"] = str(folder / Path(held).relative_to(there))
            summary.write_text(json.dumps(document, indent=1))


def joined_plugins(drivers: str, machines: str | None) -> str:
    """The plugin modules a machine's ranks import: the driver's (which checked the
    scenario), then the machine's own that the driver does not name."""
    names = [n.strip() for text in (drivers, machines or "") for n in text.split(",")]
    return ",".join(dict.fromkeys(n for n in names if n))


def machine_folder(run_dir: Path, k: int) -> Path:
    """Where machine ``k``'s run folder lives on the driver: node 0's is the run
    folder itself, the others' beside it under ``nodes/node<k>``."""
    return run_dir if k == 0 else run_dir / NODE_FOLDERS / f"node{k}"


def pack(folder: Path, skip: tuple[str, ...] = ()) -> bytes:
    """A folder's files as gzipped tar bytes, those named in ``skip`` left out, with
    their siblings ``NAME.*`` (the checkpoints a fresh start moved aside,
    ``checkpoints.old-<time>``, stay where they are)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(folder.iterdir()):
            if not any(path.name == s or path.name.startswith(f"{s}.") for s in skip):
                tar.add(path, arcname=path.name)
    return buffer.getvalue()


def unpack(archive: bytes, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        tar.extractall(folder, filter="data")


# ------------------------------------------------------------ on each machine
NODE_FOLDER = "overlapkit-node-"  # + host and the actor's pid: a machine's folder of a run
KEPT_FOLDER = "overlapkit-kept-"  # such a folder the driver could not take: the user's now


def _own_prefix() -> str:
    """This machine's folders' prefix: a temporary folder may be shared by machines
    (TMPDIR on a cluster's shared scratch), whose pids mean nothing here."""
    return f"{NODE_FOLDER}{socket.gethostname()}-"


def remove_orphaned_folders(temp: Path) -> None:
    """Remove this machine's run folders of actors that are gone without a `stop`
    (their driver was killed, or lost its machine): each held a run's checkpoints,
    gigabytes on a real model, left in the machine's temporary folder for good."""
    prefix = _own_prefix()
    for folder in temp.glob(f"{prefix}*-*"):
        pid = folder.name.removeprefix(prefix).partition("-")[0]
        if pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


class NodeRunner:
    """Lives on one machine of the run (a Ray actor): starts that machine's ranks as
    ``overlapkit run`` in a process group of its own, reports on them, stops them,
    and packs their run folder."""

    def __init__(self) -> None:
        remove_orphaned_folders(Path(tempfile.gettempdir()))
        self.folder = Path(tempfile.mkdtemp(prefix=f"{_own_prefix()}{os.getpid()}-"))
        self.process: subprocess.Popen[bytes] | None = None

    def where(self) -> dict[str, Any]:
        import ray

        with socket.socket() as s:  # node 0's rendezvous port (free now; taken in a moment)
            s.bind(("", 0))
            port = s.getsockname()[1]
        return {
            "ip": ray.util.get_node_ip_address(),
            "port": port,
            "node_id": ray.get_runtime_context().get_node_id(),
            "host": socket.gethostname(),
        }

    def start(
        self,
        scenario_text: str,
        node_rank: int,
        nodes: int,
        master: str,
        run_args: list[str],
        earlier: bytes | None = None,
        plugins: str | None = None,
    ) -> None:
        if earlier is not None:
            unpack(earlier, self.folder / "run")
        scenario = self.folder / "scenario.yaml"
        scenario.write_text(scenario_text)
        command = [sys.executable, "-m", "overlapkit", "run", str(scenario)]
        command += ["--out", str(self.folder / "run"), "--quiet", *run_args]
        if nodes > 1:
            command += ["--node-rank", str(node_rank), "--master", master]
        import ray

        from ..runtime.hardware import NODE_TYPE_ENV

        env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
        env["PYTHONUNBUFFERED"] = "1"
        if plugins is not None:  # the machine's Ray was started without the driver's
            env[PLUGINS] = joined_plugins(plugins, env.get(PLUGINS))
        # The launcher's node type (it starts each node with RAY_NODE_TYPE_NAME, which
        # Ray turns into this label), recorded in the run's hardware.
        labels = ray.get_runtime_context().get_node_labels()
        node_type = labels.get("ray.io/node-group") or os.environ.get("RAY_NODE_TYPE_NAME")
        if node_type:
            env[NODE_TYPE_ENV] = str(node_type)
        with (
            open(self.folder / "stdout.txt", "wb") as out,
            open(self.folder / "stderr.txt", "wb") as err,
        ):
            self.process = subprocess.Popen(
                command,
                stdout=out,
                stderr=err,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def poll(
        self, offset: int | None, wait_s: float = 0.0, manifest: bool = False
    ) -> tuple[int | None, str, int, str | None]:
        """The exit code (None while running: after waiting up to ``wait_s`` for the
        ranks to end); from ``offset`` on, the complete lines of the live step log;
        with ``manifest``, the checkpoint manifest's text (None: none yet)."""
        from ..runtime.report import LIVE_STEPS, LiveSteps

        assert self.process is not None
        try:
            code = self.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            code = None
        written = self.manifest() if manifest else None
        if offset is None:
            return code, "", 0, written
        return code, *LiveSteps.read_new(self.folder / "run" / LIVE_STEPS, offset), written

    def manifest(self) -> str | None:
        return manifest_text(self.folder / "run" / CHECKPOINTS)

    def checkpoint_chunk(self, step: int, name: str, offset: int, size: int) -> bytes | None:
        return read_chunk(self.folder / "run" / CHECKPOINTS, step, name, offset, size)

    def receive_chunk(self, step: int, name: str, offset: int, data: bytes) -> None:
        """A chunk of an earlier run's checkpoint (before `start`)."""
        write_chunk(self.folder / "run" / CHECKPOINTS, step, name, offset, data)

    def receive_manifest(self, text: str) -> None:
        """The earlier run's manifest, once its files are all here."""
        finish_files(self.folder / "run" / CHECKPOINTS, text)

    def stderr(self) -> str:
        return (self.folder / "stderr.txt").read_text(errors="replace")

    def stop(self, keep: bool = False) -> str | None:
        """The ranks stopped and their folder removed: what the driver needs of it
        (the mirrored checkpoints, the failing machine's stderr) it has by now. With
        ``keep`` (the driver could not take it all: its disk full, say) the folder is
        renamed out of `remove_orphaned_folders`' way instead; its path is returned."""
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.process.wait()
        if not keep:
            shutil.rmtree(self.folder, ignore_errors=True)
            return None
        kept = self.folder.with_name(self.folder.name.replace(NODE_FOLDER, KEPT_FOLDER, 1))
        for name in ("stdout.txt", "stderr.txt"):  # beside the run's own files
            if (self.folder / name).is_file() and (self.folder / "run").is_dir():
                shutil.copy(self.folder / name, self.folder / "run" / name)
        return str(self.folder.rename(kept))

    def collect(self) -> bytes:
        """The run folder with the run's stdout and stderr, packed (not its
        checkpoints: the driver mirrors those); removed by `stop`, once the driver
        has it all."""
        run = self.folder / "run"
        run.mkdir(exist_ok=True)
        for name in ("stdout.txt", "stderr.txt"):
            shutil.copy(self.folder / name, run / name)
        return pack(run, skip=(CHECKPOINTS, LOCK))  # the driver holds its own
