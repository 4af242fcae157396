"""Cores for parallel trials: each ``tune`` worker's trials run on cores of their own.

Trials side by side on shared cores take them from each other, and more than
their share: on 2 cores, two 1-rank trials with 2 threads each ran 10 to 25
times slower than one alone (a thread that waits for its peers spins on a core
another process needs). Each worker gets a disjoint block of the cores tune may
use (its CPU affinity; a physical core's hardware threads kept together), and its
trials run pinned to that block, whose cores their ranks divide as a run's ranks
divide a machine's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ..runtime.cores import parse_list


def split_cores(
    workers: int, cores: list[int], siblings: Callable[[int], str] | None = None
) -> list[list[int]] | None:
    """``workers`` disjoint blocks of ``cores``, in order, a physical core's hardware
    threads (``siblings(core)``: Linux's ``thread_siblings_list``) in one block; the
    first blocks take what an uneven division leaves over. With fewer physical cores
    than workers, hardware threads apart; with fewer cores than workers, one core
    each, in turn (shared: trials of one thread each take turns on a core, where
    trials sizing their threads to every core spun on each other's, 5 to 10 times
    slower). None for one worker, or where processes cannot be pinned."""
    if workers < 2 or not hasattr(os, "sched_setaffinity") or not cores:
        return None
    groups = _physical_cores(cores, siblings or _siblings_here)
    if len(groups) < workers:
        groups = [[core] for core in cores]
    if len(groups) < workers:
        return [groups[i % len(groups)] for i in range(workers)]
    size, left_over = divmod(len(groups), workers)
    blocks, start = [], 0
    for i in range(workers):
        end = start + size + (i < left_over)
        blocks.append(sorted(core for group in groups[start:end] for core in group))
        start = end
    return blocks


def _physical_cores(cores: list[int], siblings: Callable[[int], str]) -> list[list[int]]:
    """``cores`` grouped by physical core (hardware threads of one core together),
    in the order of each group's first core."""
    groups: dict[frozenset[int], list[int]] = {}
    for core in cores:
        try:
            key = frozenset(parse_list(siblings(core))) or frozenset({core})
        except (OSError, ValueError):
            key = frozenset({core})  # unknown: a core of its own
        groups.setdefault(key, []).append(core)
    return list(groups.values())


def _siblings_here(core: int) -> str:
    return Path(f"/sys/devices/system/cpu/cpu{core}/topology/thread_siblings_list").read_text()


def shared(blocks: list[list[int]]) -> bool:
    """Whether some core is in two blocks."""
    every = [core for block in blocks for core in block]
    return len(set(every)) < len(every)


def describe(blocks: list[list[int]]) -> str:
    """``0-3 | 4-7``: each worker's cores, as ranges where they run on."""
    return " | ".join(_ranges(block) for block in blocks)


def _ranges(cores: list[int]) -> str:
    spans: list[list[int]] = []
    for core in cores:
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
