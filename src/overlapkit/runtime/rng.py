"""Seeding and capturing every random number generator a run uses.

States are stored as tensors and plain Python values only, so checkpoints
load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # This rank's GPU only: a resume may see fewer GPUs (each rank its own).
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if isinstance(cuda, (list, tuple)):  # saved by an older version: every GPU's
            cuda = cuda[torch.cuda.current_device() % len(cuda)]
        torch.cuda.set_rng_state(cuda)


def same_rng(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two `capture_rng` states are the same: nothing drew in between."""
    if not same_host_rng(a, b) or not torch.equal(a["torch"], b["torch"]):
        return False
    # (CUDA started in between: its generator is new)
    return "cuda" not in a or "cuda" not in b or torch.equal(a["cuda"], b["cuda"])


def same_host_rng(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether Python's random and NumPy's are the same in two `capture_rng` states."""
    if a["python"] != b["python"] or a["numpy"].keys() != b["numpy"].keys():
        return False
    numpy_rest = [k for k in a["numpy"] if k != "keys"]
    return all(a["numpy"][k] == b["numpy"][k] for k in numpy_rest) and torch.equal(
        a["numpy"]["keys"], b["numpy"]["keys"]
    )
