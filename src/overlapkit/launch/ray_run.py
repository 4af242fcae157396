"""``overlapkit run SCENARIO --ray [ADDRESS]``: one run over ``world.nodes`` machines
of a Ray cluster, its progress on the driver, every machine's run folder gathered
into the run folder here (machine k > 0 under ``nodes/node<k>``). A run folder that
already has checkpoints is sent back to its machines first, so the run resumes."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from ..folders import new_stamped, stamped, unused
from ..runtime.checkpoint_folder import listed_steps, manifest_text
from ..runtime.report import print_summary
from ..scenarios import Scenario, dump_scenario
from .interrupt import RunInterrupted
from .ray_nodes import (
    CHECKPOINTS,
    NODE_FOLDERS,
    RayClusterError,
    RayOutcome,
    RayRunFailed,
    connect,
    machine_folder,
    placed_world,
    run_on_ray,
)
from .ray_paths import paths_from_here

REFUSAL_LINES = 12  # of a machine's error, in the driver's one line


class RayRunRefused(RuntimeError):
    """A machine's ranks refused the run (exit status 2): the user's mistake, found on
    that machine (data that the driver has and that machine lacks, say)."""


def run_on_cluster(
    scenario: Scenario,
    run_dir: Path | None,
    address: str,
    fresh: bool,
    quiet: bool,
    as_json: bool,
    on_folder: Callable[[Path], None] | None = None,
) -> dict[str, Any]:
    scenario.data.check()
    folder = (scenario.optimizations.get("checkpoint") or {}).get("dir", CHECKPOINTS)
    if folder != CHECKPOINTS:
        raise RayClusterError(
            f"checkpoint.dir is {folder!r}: under --ray each machine keeps its checkpoints in "
            f"its run folder's {CHECKPOINTS}/, which this machine mirrors and sends back to "
            "resume; leave checkpoint.dir unset"
        )
    connect(address)
    # From here on `kill` stops the run as Ctrl-C does (ray.init set Ray's handlers).
    received: list[int] = []  # the signal that stopped it (Ray may turn it to Ctrl-C's)
    with _sigterm_as_interrupt(received):
        paths_from_here(scenario)
        world = scenario.world = placed_world(scenario.world)  # one decision for all machines
        scenario.check_setup(world.ranks, gpus_here=False)
        run_dir = run_dir or new_stamped(Path("runs"), scenario.name)
        run_dir.mkdir(parents=True, exist_ok=True)
        if on_folder is not None:
            on_folder(run_dir)
        errors = Console(stderr=True)
        resume = {} if fresh else _earlier_folders(run_dir, world.nodes)
        if fresh:
            _move_aside(run_dir, world.nodes)
        if resume:
            errors.print(f"resuming from the checkpoints in {run_dir} ({len(resume)} machine(s))")
        total = scenario.train.total_steps  # warm-up and measured: the step numbers it shows
        progress = None if quiet or as_json else _progress(total)
        task = None if progress is None else progress.add_task("steps", total=total)

        def on_lines(text: str) -> bool:
            if progress is not None:
                steps = [json.loads(line)["step"] for line in text.splitlines() if line.strip()]
                if steps:
                    progress.update(task, completed=max(steps) + 1)
            return False

        if progress is not None:
            progress.start()
        try:
            outcome = run_on_ray(
                dump_scenario(scenario),
                world,
                run_dir,
                run_args=["--fresh"] if fresh else [],
                on_lines=on_lines,
                resume=resume,
            )
        except KeyboardInterrupt:
            signum = received[0] if received else signal.SIGINT
            newest = _newest_checkpoint(run_dir, world.nodes)
            raise RunInterrupted(signum, None, newest) from None
        finally:
            if progress is not None:
                progress.stop()
        _raise_for(outcome, run_dir, world.nodes)
    summary = json.loads((run_dir / "summary.json").read_text())
    if not (quiet or as_json):  # the run is over: a `kill` now is Ray's handlers' again
        print_summary(summary)
        errors.print(f"run folder: {run_dir}")
    return summary


def _raise_for(outcome: RayOutcome, run_dir: Path, nodes: int) -> None:
    """The error of a run that did not end well, naming the checkpoints kept."""
    if outcome.lost:
        raise RayRunFailed(f"{outcome.lost}; {_kept(run_dir, nodes)}")
    if outcome.returncode == 2:
        held = _newest_checkpoint(run_dir, nodes) is not None
        raise RayRunRefused(
            f"{outcome.failed_on}: {_refusal(outcome.stderr)} (found on that machine: its "
            "files, data and installed packages are its own)"
            + (f"; {_kept(run_dir, nodes)}" if held else "")
        )
    if not outcome.ok:
        tail = "\n".join(outcome.stderr.strip().splitlines()[-15:])
        raise RayRunFailed(
            f"exit codes per machine {outcome.returncodes}; {_kept(run_dir, nodes)}\n{tail}"
        )


@contextmanager
def _sigterm_as_interrupt(received: list[int]) -> Iterator[None]:
    """SIGTERM (`kill`) stops the run as Ctrl-C does: the machines' ranks stopped, one
    line, status 143. The handlers that ray.init set (Ray's crash handler printed a
    6-line C++ dump, then its own exited with status 15) are replaced meanwhile. The
    signal goes in ``received``: inside a blocking ray.get Ray turns the exception
    raised here into a plain KeyboardInterrupt. Once one came, later ones wait."""

    def stop(signum: int, _frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one waits for the first
        received.append(signum)
        raise RunInterrupted(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        if not received:
            signal.signal(signal.SIGTERM, previous)


def _refusal(stderr: str) -> str:
    """What a machine's ``overlapkit run`` said when it refused the run: its error,
    from its ``error`` line on, ``REFUSAL_LINES`` at most (its last 3 lines were
    taken: a warning printed just before joined the message, a longer one was cut),
    else its last lines."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if line.startswith("error")]
    said = lines[starts[-1] :][:REFUSAL_LINES] if starts else lines[-3:]
    return " ".join(said).removeprefix("error: ")


def _newest_checkpoint(run_dir: Path, nodes: int) -> int | None:
    """The newest checkpoint that reached the driver from every machine (each
    machine's mirror: a resume needs all of their files)."""
    held = []
    for k in range(nodes):
        text = manifest_text(machine_folder(run_dir, k) / CHECKPOINTS)
        held.append(set(listed_steps(text)) if text else set())
    common = set.intersection(*held) if held else set()
    return max(common) if common else None


def _kept(run_dir: Path, nodes: int) -> str:
    newest = _newest_checkpoint(run_dir, nodes)
    if newest is None:
        return (
            "no checkpoint of every machine had reached this machine: the same command "
            "starts over (with --fresh if some machines' checkpoints are there)"
        )
    return f"the checkpoints up to step {newest} are in {run_dir}: the same command resumes there"


def _earlier_folders(run_dir: Path, nodes: int) -> dict[int, Path]:
    """The machines' folders of an earlier run into ``run_dir`` that hold checkpoints."""
    folders = {k: machine_folder(run_dir, k) for k in range(nodes)}
    found = {k: f for k, f in folders.items() if (f / "checkpoints").is_dir()}
    if found and len(found) != nodes:
        raise RayClusterError(
            f"{run_dir} holds checkpoints of {len(found)} machine(s), not {nodes}: "
            "run with --fresh to start over (they are kept)"
        )
    return found


def _move_aside(run_dir: Path, nodes: int) -> None:
    """A fresh start into a folder with checkpoints keeps them, beside the new ones:
    every machine's, those of an earlier run over more machines too (an export would
    take their stages for this run's)."""
    earlier = sorted(p for p in (run_dir / NODE_FOLDERS).glob("*") if p.is_dir())
    for folder in dict.fromkeys([*(machine_folder(run_dir, k) for k in range(nodes)), *earlier]):
        if (folder / "checkpoints").is_dir():
            (folder / "checkpoints").rename(unused(stamped(folder, "checkpoints.old")))


def _progress(total: int) -> Progress:
    import ray

    return Progress(
        TextColumn(
            f"[bold]training on the cluster at {escape(ray.get_runtime_context().gcs_address)}[/]"
        ),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} steps"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )
