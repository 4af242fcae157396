"""Cores for parallel trials: each ``tune`` worker's trials run on cores of their own.

Trials side by side on shared cores take them from each other, and more than
their share: on 2 cores, two 1-rank trials with 2 threads each ran 10 to 25
times slower than one alone (a thread that waits for its peers spins on a core
another process needs). Each worker gets a disjoint block of the cores tune may
use (its CPU affinity), and its trials run pinned to that block, whose cores
their ranks divide as a run's ranks divide a machine's.
"""

from __future__ import annotations


def split_cores(workers: int, cores: list[int]) -> list[list[int]] | None:
    """``workers`` disjoint blocks of ``cores``, in order (the first blocks take the
    cores an uneven division leaves over); None for one worker, or for fewer cores
    than workers (every trial then sees them all, and `tune` says they contend)."""
    if workers < 2 or len(cores) < workers:
        return None
    size, left_over = divmod(len(cores), workers)
    blocks, start = [], 0
    for i in range(workers):
        end = start + size + (i < left_over)
        blocks.append(cores[start:end])
        start = end
    return blocks


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
