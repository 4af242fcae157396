"""Trials on a Ray cluster (``overlapkit tune --ray``): each trial is the same
``overlapkit run`` as on one machine, placed by `launch.ray_nodes` (a placement
group, an actor per machine), its run folder brought back into the tune folder.
The driver keeps the study: Optuna asks and tells here, from one thread per trial
in flight."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import yaml

from ..launch.config import WorldConfig
from ..launch.ray_nodes import (
    RayClusterError,
    connect,
    placed_world,
    run_on_ray,
    runs_that_fit,
)
from ..launch.ray_paths import data_root_from_here
from .trial import NODE_LOST, StepWatch, TrialFailed, TrialStopped, failure_of


class RayTrials:
    """Where and how many trials run at once; `run` has `trial.run_trial`'s shape."""

    def __init__(self, world: WorldConfig, address: str, max_concurrent: int | None) -> None:
        connect(address)
        # `kill` ends tune at once, as without Ray (the same command continues the
        # study): the handlers that ray.init set printed a C++ dump and aborted it.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self.world = placed_world(world)
        if max_concurrent is not None and max_concurrent < 1:
            raise RayClusterError("--max-concurrent must be at least 1")
        # A cluster that must grow first still runs one: its autoscaler sees the demand.
        self.fits_now = runs_that_fit(self.world)
        self.concurrency = max_concurrent or max(1, self.fits_now)

    def describe(self) -> str:
        import ray

        nodes = [n for n in ray.nodes() if n.get("Alive")]
        total = ray.cluster_resources()
        waiting = (
            "; none fits on its live machines now: trials wait for room (an autoscaler may "
            "add machines)"
            if not self.fits_now
            else ""
        )
        address = ray.get_runtime_context().gcs_address
        return (
            f"Ray cluster at {address}: {len(nodes)} machines, {total.get('CPU', 0):g} CPUs, "
            f"{total.get('GPU', 0):g} GPUs; up to {self.concurrency} trial(s) in flight, "
            f"each on {self.world.nodes} machine(s) x {self.world.nprocs} rank(s){waiting}"
        )

    def run(
        self,
        data: dict[str, Any],
        folder: Path,
        timeout_s: float,
        on_step: Any = None,
        give_up_at: float | None = None,
    ) -> dict[str, Any]:
        """One trial; ``give_up_at`` (tune's deadline): `OutOfTime` if it still waits
        for room on the cluster then (it ran whole, past tune's --timeout)."""
        folder.mkdir(parents=True, exist_ok=True)
        world = self.world.model_dump(include={"device", "threads"})
        data = {**data_root_from_here(data), "world": {**(data.get("world") or {}), **world}}
        text = yaml.safe_dump(data, sort_keys=False)
        (folder / "scenario.yaml").write_text(text)
        watch = StepWatch(on_step)
        outcome = run_on_ray(
            text,
            self.world,
            folder / "run",
            run_args=["--fresh"],
            timeout_s=timeout_s,
            on_lines=watch.feed if on_step is not None else None,
            checkpoints=False,
            give_up_at=give_up_at,
        )
        if outcome.lost:
            raise TrialFailed(NODE_LOST, outcome.lost)
        if outcome.timed_out:
            raise TrialFailed("timeout", f"no result within {timeout_s:g} s")
        if outcome.stopped:
            raise TrialStopped
        if not outcome.ok:
            raise failure_of(outcome.returncode, outcome.stderr)
        return json.loads((folder / "run" / "summary.json").read_text())
