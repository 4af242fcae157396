"""Run a scenario: prepare its run folder, start its ranks, train, summarise."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .earlier_run import saved_setup
from .folders import claim, stamped
from .launch.interrupt import RunInterrupted, await_signal, peer_left, stop_on_signals
from .launch.local import NodePlace, is_rank_zero, launch_local, torchrun_run_dir, under_torchrun
from .runtime import CombinationError, Session
from .runtime.distributed import close_world, init_world
from .runtime.loop import train
from .runtime.optimization import needed_environment
from .runtime.rng import seed_everything
from .scenarios import Scenario, dump_scenario
from .warnings_line import one_line_warnings


def default_run_dir(scenario: Scenario, root: Path = Path("runs")) -> Path:
    """The name of a run folder nobody named: ``runs/<scenario>-<time>`` (claimed with
    `folders.claim`, so a run started in the same second gets ``-2``), or under torchrun
    ``runs/<scenario>-<run id>``, which every rank can name without talking to the others
    (and a restarted job finds again)."""
    if under_torchrun():
        return torchrun_run_dir(scenario.name, root)
    return stamped(root, scenario.name)


def rank_main(
    scenario: Scenario, run_dir: Path | None, progress: bool, print_summary: bool
) -> dict[str, Any]:
    """One rank's whole run; the same under overlapkit's launcher and torchrun.
    SIGINT/SIGTERM end it with `RunInterrupted`, saying the step it reached."""
    one_line_warnings()  # a rank started by spawn or torchrun shows them as the CLI does
    session: Session | None = None
    tf_loop: list[Any] = []  # TensorFlow's loop, once made: it says where it stopped
    ranks = 1
    with stop_on_signals() as received:
        try:
            if scenario.framework == "tensorflow":  # the one place the framework is chosen
                from .backends.tensorflow.worker import tf_rank_main

                def started(loop: Any) -> None:
                    loop.state.setup = saved_setup(scenario)  # recorded beside its checkpoints
                    tf_loop.append(loop)

                return tf_rank_main(scenario, run_dir, progress, print_summary, started)
            cfg = scenario.train
            optimizations = scenario.build_optimizations()
            world = init_world(
                scenario.world.device,
                scenario.world.backend,
                scenario.world.threads,
                timeout_s=scenario.world.timeout_s,
                environment=partial(needed_environment, optimizations),
            )
            ranks = world.world_size
            try:
                said = deterministic_algorithms(world.device) if cfg.deterministic else None
                seed_everything(cfg.seed)  # the same initial model on every rank
                model = scenario.model.build()
                session = Session(
                    optimizations,
                    policy=scenario.scheduler.build(),
                    world=world,
                    precision=cfg.precision,
                    warmup_steps=cfg.warmup_steps,
                    accumulate=cfg.accumulate,
                    run_dir=run_dir,
                    progress=progress,
                    print_summary=print_summary,
                    name=scenario.name,
                    trace=scenario.scheduler.trace,
                    tensorboard=scenario.log.tensorboard,
                )
                if said is not None:
                    session.notes.append(said)
                session.state.setup = saved_setup(scenario)  # recorded beside its checkpoints
                result = _train(scenario, session, model)
                close_world(world)
                return result
            finally:
                if cfg.deterministic:  # the process may run more (benchmarks, the API)
                    torch.use_deterministic_algorithms(False)
                if world.world_size > 1 and dist.is_initialized() and not world.adopted:
                    dist.destroy_process_group()  # after a failure: no barrier, a peer may be gone
                    gc.collect()  # free gloo's last work now, not in the interpreter's exit
        except BaseException as error:
            # An error a signal caused (a peer that left mid-collective) is the signal's;
            # the launcher signals this rank a moment after the peer left.
            if received.first is None and ranks > 1 and peer_left(error):
                await_signal(received, PEER_SIGNAL_WAIT_S)
            if received.first is None:
                raise
            stoppable = session if session is not None else (tf_loop or [None])[0]
            step, checkpoint = stoppable.stopped() if stoppable is not None else (None, None)
            finished = bool(getattr(stoppable, "finished", False))  # its results written
            raise RunInterrupted(received.first, step, checkpoint, finished) from None


PEER_SIGNAL_WAIT_S = 3.0  # launchers poll their ranks every 0.1 s (torchrun, ours)


def deterministic_algorithms(device: torch.device) -> str | None:
    """``train.deterministic``: torch's deterministic algorithms. On a GPU, an
    operation with no deterministic CUDA kernel (torch's list includes NLLLoss and
    adaptive pooling's backward) warns instead of stopping the run, and the returned
    note says that such runs are not bit-reproducible; cuBLAS gets the fixed workspace
    its determinism needs (before its first use)."""
    if device.type != "cuda":
        torch.use_deterministic_algorithms(True)
        return None
    # cuBLAS reads it when it first starts in the process (a rank's process is new).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    return (
        "train.deterministic on a GPU: torch's deterministic kernels where it has them; "
        "an operation without one warns once (UserWarning) and makes the run "
        "reproducible only up to its rounding"
    )


def _train(scenario: Scenario, session: Session, model: torch.nn.Module) -> dict[str, Any]:
    cfg, world = scenario.train, session.world
    shard, shards = session.data_shard  # the ranks of one pipeline read the same batches
    train_loader, eval_loader = scenario.build_loaders(
        shard, shards, pin_memory=world.device.type == "cuda"
    )
    seed_everything(cfg.seed + 1 + world.rank)  # dropout and the like differ per rank
    return train(cfg, session, model, train_loader, eval_loader)


def run_scenario(
    scenario: Scenario,
    run_dir: Path | None = None,
    *,
    progress: bool = True,
    print_summary: bool = True,
    node: NodePlace | None = None,
    on_folder: Callable[[Path], None] | None = None,
) -> dict[str, Any]:
    """Run ``scenario``; return rank 0's summary (also written to ``run_dir/summary.json``).
    Without ``run_dir``, a new folder under ``runs/``; ``on_folder`` hears which, once made.
    ``node``: this machine's place when ``world.nodes`` > 1 (`launch.ray_nodes` gives
    each machine its own); the summary then comes back on node 0 only (None elsewhere)."""
    world = scenario.world
    if node is None and world.nodes > 1 and not under_torchrun():
        raise CombinationError(
            f"world.nodes: {world.nodes} asks for {world.nodes} machines: run it with --ray "
            "ADDRESS on a Ray cluster, or on each machine with --node-rank K --master HOST:PORT"
        )
    if node is not None and node.nodes != world.nodes:
        raise CombinationError(f"world.nodes is {world.nodes}, but this run has {node.nodes} nodes")
    scenario.data.check()
    ranks = int(os.environ["WORLD_SIZE"]) if under_torchrun() else world.ranks
    scenario.check_setup(ranks)
    new = run_dir is None and not under_torchrun()
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(scenario)
    for optimization in scenario.build_optimizations():
        optimization.check_run_folder(run_dir, ranks)  # before any rank starts
    if new:
        run_dir = claim(run_dir)
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
    if on_folder is not None:
        on_folder(run_dir)
    if is_rank_zero():
        (run_dir / "scenario.yaml").write_text(dump_scenario(scenario))
        print(f"overlapkit: run folder {run_dir}", file=sys.stderr, flush=True)
    if under_torchrun() or world.ranks == 1:
        return rank_main(scenario, run_dir, progress, print_summary)
    results = launch_local(
        rank_main, world.nprocs, scenario, run_dir, progress, print_summary, node=node
    )
    return results.get(0)
