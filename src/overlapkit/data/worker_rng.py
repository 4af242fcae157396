"""The random state of a DataLoader's worker processes, for an exact resume mid-epoch.

A worker seeds torch, `random` and numpy's global RNG when it starts (from the
epoch's base seed and its id), then draws from them in the dataset's
``__getitem__`` (random augmentation) and the collate function (mixup). Batch i
of an epoch goes to worker i mod W. A resume that skips the first k batches by
index gives new worker m the batches the run's worker (k + m) mod W had; for the
same draws, it must start from that worker's state after its last batch before
k, which no worker of the new run ever reached (it made none of those draws).

So each batch a worker collates carries its RNG state after it (`Stamping`);
the loader keeps each worker's latest (`ScriptLoader`) and saves them; a resumed
pass starts its workers from them (`WorkerStart`). What the states hold is
plain data (bytes, ints, tuples): the checkpoint file stores it as tensors and
numbers, never pickled.
"""

from __future__ import annotations

import random
import sys
from array import array
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils.data import get_worker_info

# (torch's state bytes, random's (version, state bytes, gauss), numpy's global state or None)
State = tuple[bytes, tuple, tuple | None]


class Stamped(NamedTuple):
    """A batch from a worker, with the id of the run's worker it is (after a resume,
    the one it plays) and its RNG state after the batch."""

    batch: Any
    worker: int
    state: State


def capture() -> State:
    """This process's RNG states (torch's, random's, numpy's global one)."""
    numpy = sys.modules.get("numpy")
    np_state = None
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        np_state = (name, keys.tobytes(), int(pos), int(has_gauss), float(cached))
    version, internal, gauss = random.getstate()  # 625 ints: bytes travel faster
    py_state = (version, array("I", internal).tobytes(), gauss)
    return torch.get_rng_state().numpy().tobytes(), py_state, np_state


def drawn_between(before: State, after: State) -> list[str]:
    """The global generators that drew between two `capture` states of one process."""
    names = ("torch", "random", "numpy")
    return [name for name, a, b in zip(names, before, after, strict=True) if a != b]


def restore(state: State) -> None:
    torch_bytes, py_state, np_state = state
    torch.set_rng_state(torch.frombuffer(bytearray(torch_bytes), dtype=torch.uint8))
    version, internal, gauss = py_state
    random.setstate((version, tuple(array("I", internal)), gauss))
    if np_state is not None:
        import numpy

        name, keys, pos, has_gauss, cached = np_state
        numpy.random.set_state(
            (name, numpy.frombuffer(keys, dtype=numpy.uint32).copy(), pos, has_gauss, cached)
        )


def reseed(base_seed: int, worker_id: int) -> None:
    """Seed this process as a DataLoader seeds its worker ``worker_id``."""
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    if "numpy" in sys.modules:
        import numpy
        from torch.utils.data._utils.worker import _generate_state

        numpy.random.seed(_generate_state(base_seed, worker_id))


class Stamping:
    """A collate function that stamps each batch with the worker's RNG state."""

    def __init__(self, collate: Callable[[Any], Any]) -> None:
        self.collate = collate

    def __call__(self, samples: Any) -> Any:
        batch = self.collate(samples)
        info = get_worker_info()
        return batch if info is None else Stamped(batch, info.id, capture())


class WorkerStart:
    """A worker init function: new worker m plays the run's worker ``(m + shift) % W``
    (it gets that one's batches): it starts from that worker's saved state, or, with
    none saved, is seeded as that worker was. The script's own init function runs
    first, with the id of the worker it plays."""

    def __init__(
        self, states: dict[int, State], shift: int, init: Callable[[int], None] | None
    ) -> None:
        self.states, self.shift, self.init = states, shift, init

    def __call__(self, worker_id: int) -> None:
        info = get_worker_info()
        plays = (worker_id + self.shift) % info.num_workers
        if plays != worker_id:
            base_seed = info.seed - worker_id
            reseed(base_seed, plays)
            # What the script's init function and dataset read: the worker it plays.
            object.__setattr__(info, "id", plays)
            object.__setattr__(info, "seed", base_seed + plays)
        if self.init is not None:
            self.init(plays)
        if plays in self.states:
            restore(self.states[plays])


def to_saved(state: State) -> tuple:
    """A state as the checkpoint file stores it: tensors and numbers."""
    torch_bytes, (version, internal, gauss), np_state = state
    saved_np = None
    if np_state is not None:
        name, keys, pos, has_gauss, cached = np_state
        saved_np = (name, _bytes_tensor(keys), pos, has_gauss, cached)
    return _bytes_tensor(torch_bytes), (version, _bytes_tensor(internal), gauss), saved_np


def from_saved(saved: Any) -> State:
    torch_state, (version, internal, gauss), saved_np = saved
    np_state = None
    if saved_np is not None:
        name, keys, pos, has_gauss, cached = saved_np
        np_state = (name, keys.numpy().tobytes(), int(pos), int(has_gauss), float(cached))
    py_state = (int(version), internal.numpy().tobytes(), gauss)
    return torch_state.numpy().tobytes(), py_state, np_state


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
