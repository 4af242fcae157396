"""The cores as Linux sees them: which ones a rank may use, pinning threads and
processes to them and lowering their priority, and reading all of it back from
/proc (what the ``partition`` policy does and what its tests check)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from pathlib import Path


def available() -> list[int]:
    """The cores this process may run on (its CPU affinity), in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def rank_share(cores: list[int], local_rank: int, local_world_size: int) -> list[int]:
    """The ranks of one machine divide its ``cores`` evenly, in order of local rank
    (the cores left over by an uneven division stay unused, as every rank then gets
    the same thread count); with fewer cores than ranks, ranks share a core."""
    if not cores:
        return []
    size = max(1, len(cores) // max(1, local_world_size))
    start = (local_rank * size) % len(cores)
    return cores[start : start + size]


def this_thread() -> int:
    """The calling thread's id as Linux knows it (what /proc/<id> and the calls here take)."""
    return threading.get_native_id()


def threads_of(pid: int | None = None) -> list[int]:
    """The thread ids of process ``pid`` (this one by default)."""
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid or 'self'}/task"))
    except OSError:
        return []


def pin(tid: int, cores: Iterable[int]) -> bool:
    """Restrict thread (or single-threaded process) ``tid`` to ``cores``; False where
    Linux does not allow it (the thread is gone, or not ours)."""
    try:
        os.sched_setaffinity(tid, set(cores))
        return True
    except (OSError, AttributeError):
        return False


def lower_priority(tid: int, nice: int) -> None:
    """Raise ``tid``'s nice value to ``nice`` (never lower it: that needs privileges)."""
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (OSError, AttributeError):
        pass


def parse_list(text: str) -> set[int]:
    """A kernel CPU list ("0-3,6") as a set of cores."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if "-" in part:
            low, high = part.split("-")
            out.update(range(int(low), int(high) + 1))
        elif part:
            out.add(int(part))
    return out


def allowed(tid: int) -> set[int]:
    """The cores thread ``tid`` may run on, read back from /proc (empty: it is gone)."""
    try:
        for line in Path(f"/proc/{tid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return parse_list(line.split(":", 1)[1])
    except OSError:
        pass
    return set()


def cpu_seconds(tid: int) -> float | None:
    """CPU time thread ``tid`` has used so far (None: it is gone)."""
    try:
        return int(Path(f"/proc/{tid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        fields = Path(f"/proc/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
