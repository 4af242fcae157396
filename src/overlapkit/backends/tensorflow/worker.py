"""One TensorFlow rank: meet the others, start the strategy, build, train.

The ranks first meet on a small gloo process group of torch's (the control
plane: where each rank's TensorFlow server listens, checkpoint agreement, the
summary's gather), with the same start-up, time-out and error reporting as a
torch run. Then each starts ``MultiWorkerMirroredStrategy`` with a ``TF_CONFIG``
naming every rank's free port. Training collectives are TensorFlow's own.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ...runtime.distributed import World, all_gather_objects, close_world, init_world
from ...runtime.gpus import check_rank_count
from ...runtime.optimization import engine_for
from . import import_tensorflow
from .step import PRECISION_POLICY


class PeerTimeoutError(RuntimeError):
    """A rank never arrived within ``world.timeout_s``."""


def join_control_plane(threads: int | None, timeout_s: float) -> World:
    try:
        return init_world("cpu", "gloo", threads, timeout_s=timeout_s)
    except Exception as error:  # torch's DistStoreError and friends: a peer never came
        if "imed out" not in str(error) and "timeout" not in str(error).lower():
            raise
        raise PeerTimeoutError(
            f"rank {os.environ.get('RANK', 0)} of {os.environ.get('WORLD_SIZE', 1)} waited "
            f"{timeout_s:g} s (world.timeout_s) for the other ranks, and not all of them "
            f"arrived: {str(error).splitlines()[0]}"
        ) from None


def _reachable_address() -> str:
    """This machine's address as the rank that hosts the control plane sees it."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if master in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master, int(os.environ.get("MASTER_PORT", 29500))))
        return probe.getsockname()[0]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_strategy(tf: Any, world: World, options: dict[str, Any], timeout_s: float) -> Any:
    """``MultiWorkerMirroredStrategy`` over every rank (each rank's TensorFlow server on
    a free port, the addresses exchanged on the control plane)."""
    host = _reachable_address()
    addresses = all_gather_objects(f"{host}:{_free_port(host)}", world)
    if world.world_size > 1:
        os.environ["TF_CONFIG"] = json.dumps(
            {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": world.rank}}
        )
    implementation = tf.distribute.experimental.CommunicationImplementation
    communication = tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=options.get("bytes_per_pack", 0),
        timeout_seconds=timeout_s,
        implementation=getattr(implementation, options.get("implementation", "auto").upper()),
    )
    # Over several workers TensorFlow installs its own SIGTERM handler (its preemption
    # notifier, in C++), which swallowed the run's: training went on until the launcher
    # killed it. The run's handlers are put back.
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=communication)
    for signum, handler in handlers.items():
        if handler is not None:
            signal.signal(signum, handler)
    return strategy


def tf_rank_main(
    scenario: Any,
    run_dir: Path | None,
    progress: bool,
    print_summary: bool,
    started: Callable[[Any], None] = lambda loop: None,
) -> Any:
    """One rank of a TensorFlow run (the same entry under the launcher and alone);
    ``started`` hears of the loop once made (after an interrupt, its ``stopped()``
    says where the run stopped)."""
    from .loop import TfLoop

    cfg = scenario.train
    world = join_control_plane(scenario.world.threads, scenario.world.timeout_s)
    tf = import_tensorflow()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = scenario.world.threads or max(1, (cores or 1) // world.local_world_size)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    gpus = tf.config.list_physical_devices("GPU")
    if gpus and scenario.world.device == "cpu":
        tf.config.set_visible_devices([], "GPU")
    elif gpus:  # one GPU per rank, never shared
        check_rank_count(world.local_world_size, len(gpus))
        tf.config.set_visible_devices(gpus[world.local_rank], "GPU")
    optimizations = scenario.build_optimizations()
    engines = [engine_for(opt, "tensorflow") for opt in optimizations]
    options: dict[str, Any] = {}
    for engine in engines:
        options.update(getattr(engine, "communication_options", dict)())
    strategy = start_strategy(tf, world, options, scenario.world.timeout_s)
    if cfg.deterministic:
        tf.config.experimental.enable_op_determinism()
    import keras

    keras.mixed_precision.set_global_policy(PRECISION_POLICY[cfg.precision])
    keras.utils.set_random_seed(cfg.seed)  # the same initial model on every rank
    try:
        loop = TfLoop(scenario, world, strategy, engines, optimizations, run_dir)
        started(loop)
        summary = loop.run(progress, print_summary)
        close_world(world)
        return summary
    finally:
        if world.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()  # after a failure: no barrier, a peer may be gone
            gc.collect()
