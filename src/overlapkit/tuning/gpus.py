"""GPUs for parallel trials: each ``tune`` worker gets GPUs of its own.

Trials running side by side on one GPU take its time from each other and
measure lower, as on shared cores, so every worker's trials see only that
worker's GPUs, through ``CUDA_VISIBLE_DEVICES`` (see `trial.run_trial`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from . import TuneError

VISIBLE = "CUDA_VISIBLE_DEVICES"


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[str]:
    """The GPUs this process may use, as ids ``CUDA_VISIBLE_DEVICES`` takes: the
    entries of ``CUDA_VISIBLE_DEVICES`` when it is set (indices or UUIDs such as
    ``GPU-...``, kept as written, so a child's list names the same GPUs), else
    ``0 .. device_count - 1``."""
    environ = os.environ if environ is None else environ
    value = environ.get(VISIBLE)
    if value is not None:
        return [entry.strip() for entry in value.split(",") if entry.strip()]
    import torch  # only here: listing GPUs is the one thing this module needs it for

    return [str(index) for index in range(torch.cuda.device_count())]


def split_gpus(workers: int, ranks_per_trial: int, visible: list[str]) -> list[list[str]]:
    """``workers`` disjoint lists of ``ranks_per_trial`` ids from ``visible``, in
    order: worker ``i`` gets the ``i``-th block, one GPU per rank of its trials.
    GPUs beyond ``workers * ranks_per_trial`` are left unused (a trial runs on
    ``ranks_per_trial`` of them, and sharing one between workers would let the
    trials slow each other down). Raises `TuneError` if they do not fit."""
    needed = workers * ranks_per_trial
    if needed > len(visible):
        raise TuneError(
            f"{workers} workers x {ranks_per_trial} ranks per trial (world.nprocs) need "
            f"{needed} GPUs, but {len(visible)} are visible ({','.join(visible) or 'none'}): "
            "use fewer --workers or a smaller world.nprocs, so that each worker's trials "
            "have GPUs of their own"
        )
    return [visible[i * ranks_per_trial : (i + 1) * ranks_per_trial] for i in range(workers)]
