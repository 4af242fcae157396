"""Start N local ranks with PyTorch's elastic launcher (the engine behind torchrun),
alone or as one machine of several (`NodePlace`: static rendezvous at node 0).

The ranks get the same environment torchrun gives them, so a rank's entry
point cannot tell the two apart. When any rank fails, the launcher stops the
others at once and `RankFailedError` carries the error of the rank that
failed first: a rank blocked in a collective when its peer died fails too,
later, and is not the cause.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import select
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .interrupt import (
    RunInterrupted,
    exit_now,
    ranks_hold_ctrl_c_until_ready,
    release_held_ctrl_c,
)

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

_FAILURE_DIR_ENV = "OVERLAPKIT_FAILURE_DIR"
# multiprocessing's resource tracker, started for the ranks' queues (or shared by tune's
# trials), warned of "leaked semaphore objects" it then cleaned up when a rank or trial
# was killed (SIGKILL, the OOM killer): a line under the run's own error that asks
# nothing of anyone. It reads its warning filters from the environment it starts in.
_TRACKER_QUIET = "ignore::UserWarning:multiprocessing.resource_tracker"


@contextmanager
def resource_tracker_quiet() -> Iterator[None]:
    """Processes started inside (the ranks, tune's forkserver) start multiprocessing's
    resource tracker, if they do, without its "leaked semaphore objects" warning."""
    warnings = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, (warnings, _TRACKER_QUIET)))
    try:
        yield
    finally:
        if warnings is None:
            os.environ.pop("PYTHONWARNINGS", None)
        else:
            os.environ["PYTHONWARNINGS"] = warnings


class RankFailedError(RuntimeError):
    """A rank of a multi-rank run failed; ``rank`` and ``details`` say which and why."""

    def __init__(self, rank: int, details: str, raised: dict[str, str] | None = None) -> None:
        self.rank = rank
        self.details = details.rstrip()
        # The rank's exception: its class ("module:qualname") and message, when it raised one.
        self.raised = raised
        super().__init__(f"rank {rank} failed:\n{self.details}")


@dataclass(frozen=True)
class NodePlace:
    """This machine's place in a run over several: node ``rank`` of ``nodes``, meeting
    the others at ``master`` ("host:port", where node 0 listens)."""

    nodes: int
    rank: int
    master: str

    def __post_init__(self) -> None:
        host, _, port = self.master.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--master must be HOST:PORT (a port 1-65535), not {self.master!r}")
        if not 0 <= self.rank < self.nodes:
            raise ValueError(f"--node-rank must be in 0..{self.nodes - 1}, not {self.rank}")


def under_torchrun() -> bool:
    """True when this process is one rank of a torchrun (or elastic) launch."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def torchrun_run_dir(name: str, root: Path = Path("runs")) -> Path:
    """A torchrun rank's run folder when none is named: ``root/<name>-<run id>``, which
    every rank can name without talking to the others (and a restarted job finds
    again); ``-port<MASTER_PORT>`` without a rendezvous id (``--rdzv-id``)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    suffix = run_id if run_id != "none" else f"port{os.environ.get('MASTER_PORT', '0')}"
    return root / f"{name}-{suffix}"


def is_rank_zero() -> bool:
    """Whether this process speaks for the run: always, but under torchrun rank 0 only."""
    return not under_torchrun() or int(os.environ.get("RANK", "0")) == 0


def alive(pid: int) -> bool:
    """Whether a process ``pid`` is there (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with_parent() -> None:
    """Linux kills this process when its parent dies: ranks never outlive their
    launcher, nor a launcher the Ray actor that started it (a lost machine, a killed
    driver). Elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def die_with(pid: int) -> None:
    """Kill this process and its process group once process ``pid`` has ended: for a
    process a server started (a forkserver, which outlives the one that asked for
    it). A thread watches, through a pidfd where there are pidfds."""
    try:
        ended: int | None = os.pidfd_open(pid)
    except ProcessLookupError:  # already gone
        os.killpg(0, signal.SIGKILL)
        return
    except (AttributeError, OSError):  # no pidfds here
        ended = None

    def watch() -> None:
        if ended is not None:
            readable = select.poll()  # readable once the process ended
            readable.register(ended, select.POLLIN)
            readable.poll()
        else:
            while alive(pid):
                time.sleep(1.0)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="overlapkit-die-with", daemon=True).start()


def _run_rank(fn: Callable[..., Any], *args: Any) -> Any:
    """Runs ``fn`` in a rank; on an exception writes when and what failed, then re-raises."""
    die_with_parent()
    try:
        release_held_ctrl_c()  # a Ctrl-C since the rank started arrives now
        result = fn(*args)
    except BaseException as error:
        if type(error) is KeyboardInterrupt:  # before the run took SIGINT: a stop all the same
            error = RunInterrupted(signal.SIGINT)
        folder = os.environ.get(_FAILURE_DIR_ENV)
        if folder:
            rank = int(os.environ.get("RANK", 0))
            record = {"rank": rank, "time": time.time()}
            if isinstance(error, RunInterrupted):
                record.update(error.record())
            else:
                record["error"] = "".join(traceback.format_exception(error))
                kind = type(error)
                record["raised"] = {
                    "type": f"{kind.__module__}:{kind.__qualname__}",
                    "message": str(error),
                }
            Path(folder, f"rank{rank}.json").write_text(json.dumps(record))
        if isinstance(error, RunInterrupted):
            exit_now(error.exit_code)  # no traceback: the launcher tells the user
        raise
    # The rank is done: its exit skips the collector's passes over all of torch's
    # objects (a second or more of the launcher's wait for it, per rank).
    gc.freeze()
    return result


def _quiet_launcher_logs() -> None:
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    # torch gives some of its loggers a level of their own: quiet each, not just the parents.
    named = [n for n in logging.root.manager.loggerDict if n.startswith(prefixes)]
    for name in (*prefixes, *named, "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _launch_config(nprocs: int, node: NodePlace | None) -> LaunchConfig:
    from torch.distributed.launcher.api import LaunchConfig

    if node is None or node.nodes == 1:
        return LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nprocs,
            run_id=uuid.uuid4().hex,
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",  # a free port, chosen by the OS
            max_restarts=0,
            monitor_interval=0.1,
            start_method="spawn",
        )
    # Static: node ranks are given (node 0 holds the store), so every node knows which
    # ranks are its own before they meet, and no node can take another's place.
    return LaunchConfig(
        min_nodes=node.nodes,
        max_nodes=node.nodes,
        nproc_per_node=nprocs,
        run_id="overlapkit-" + node.master.replace(":", "-"),
        rdzv_backend="static",
        rdzv_endpoint=node.master,
        rdzv_configs={"rank": node.rank, "timeout": RENDEZVOUS_TIMEOUT_S},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )


RENDEZVOUS_TIMEOUT_S = 300  # how long node 0 waits for the others (machines boot slowly)


def launch_local(
    fn: Callable[..., Any], nprocs: int, *args: Any, node: NodePlace | None = None
) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``nprocs`` local ranks; return each rank's result (by global
    rank). ``node``: this machine's place when the run spans several.

    Raises `RankFailedError` naming the first rank that failed, with its traceback.
    """
    # torch here, not at the top: `die_with_parent` is for the Ray actor too, which needs no torch.
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    _quiet_launcher_logs()
    handlers = {s: signal.getsignal(s) for s in _LAUNCHER_SIGNALS}  # elastic replaces them
    with (
        tempfile.TemporaryDirectory(prefix="overlapkit-ranks-") as failures,
        ranks_hold_ctrl_c_until_ready(Path(failures)),
        resource_tracker_quiet(),
    ):
        config = _launch_config(nprocs, node)
        previous = os.environ.get(_FAILURE_DIR_ENV)
        os.environ[_FAILURE_DIR_ENV] = failures  # inherited by the ranks
        try:
            return elastic_launch(config, _run_rank)(fn, *args)
        except SignalException as error:
            # The launcher was signalled: it passed the signal on and waited for the ranks.
            raise _interruption(_records(failures), int(error.sigval)) from None
        except ChildFailedError as error:
            everything = _records(failures)
            recorded = {r: rec for r, rec in everything.items() if "error" in rec}
            died = [f for r, f in error.failures.items() if r not in everything and f.exitcode < 0]
            if not recorded and not died and everything:  # only the ranks were signalled
                raise _interruption(everything, None) from None
            # Ranks the launcher stopped (SIGTERM) after another failed are not the cause.
            # A rank that died without a Python error (a signal: a crash, the OOM killer)
            # is the likelier cause: its peers then fail with "connection reset".
            silent = {
                rank: f
                for rank, f in error.failures.items()
                if rank not in recorded and f.exitcode < 0
            }
            if silent:
                rank, failure = min(silent.items(), key=lambda item: item[1].timestamp)
                others = "".join(
                    f"\n\nrank {r} failed after it:\n{rec['error']}"
                    for r, rec in sorted(recorded.items())
                )
                raise RankFailedError(
                    rank,
                    f"died with {failure.signal_name()} (exit code {failure.exitcode}){others}",
                ) from None
            if recorded:
                first = min(recorded.values(), key=lambda r: r["time"])
                raise RankFailedError(first["rank"], first["error"], first.get("raised")) from None
            rank, failure = error.get_first_failure()
            message = failure.message
            if isinstance(message, dict):
                message = message.get("message", str(message))
            raise RankFailedError(rank, f"{message} (exit code {failure.exitcode})") from None
        finally:
            if previous is None:
                os.environ.pop(_FAILURE_DIR_ENV, None)
            else:
                os.environ[_FAILURE_DIR_ENV] = previous
            for s, handler in handlers.items():
                signal.signal(s, handler)


_LAUNCHER_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def _records(failures: str) -> dict[int, dict[str, Any]]:
    """What each rank that failed or was interrupted wrote, by rank."""
    return {
        r["rank"]: r for r in (json.loads(p.read_text()) for p in Path(failures).glob("rank*.json"))
    }


def _interruption(recorded: dict[int, dict[str, Any]], signum: int | None) -> RunInterrupted:
    """One `RunInterrupted` for the run: rank 0's step (ranks stop within a step of
    each other), the signal the launcher got or the ranks' own."""
    stopped = [r for _, r in sorted(recorded.items()) if "interrupted" in r]
    if not stopped:
        return RunInterrupted(signum or signal.SIGINT)
    first = RunInterrupted.from_record(stopped[0])
    return RunInterrupted(signum or first.signum, first.step, first.checkpoint_step, first.finished)
