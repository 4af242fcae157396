"""Which rank this process is, on which device, in which process group.

Ranks learn their place from the environment variables that ``torchrun``
sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT); overlapkit's own launcher sets the same ones, so one entry
point runs unchanged under either.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .background import settle_at_exit
from .cores import available
from .gpus import GPUSetupError, check_rank_count
from .hardware import this_machine


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    adopted: bool = False  # the process group was started by someone else (Ray Train)
    threads: int | None = None  # compute threads the user asked for (None: the default)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(device: str) -> str:
    """``auto``: cuda where a CUDA device is visible, else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def pick_device(device: str, local_rank: int) -> torch.device:
    device = resolve_device(device)
    if device == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise GPUSetupError("world.device is cuda but no CUDA device is available")
        if local_rank >= count:  # never share a GPU silently (see gpus.check_rank_count)
            check_rank_count(local_rank + 1, count)
        return torch.device("cuda", local_rank)
    return torch.device(device)


def resolve_backend(backend: str, device_type: str) -> str:
    """``auto``: nccl on CUDA, gloo on CPU."""
    if backend == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    return backend


def process_group_backend(backend: str) -> str:
    """What `init_process_group` gets: under nccl, one group that also carries CPU
    collectives (object gathers, evaluation counts, checkpoint coordination) on gloo,
    since an NCCL-only group refuses CPU tensors."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def init_world(
    device: str = "auto",
    backend: str = "auto",
    threads: int | None = None,
    timeout_s: float = 300,
    environment: Callable[[str], Mapping[str, str]] | None = None,
) -> World:
    """Join the process group described by the environment (none for one rank), or
    adopt the one already started in this process (Ray Train's ``TorchTrainer`` starts
    it before the training function): then its owner also tears it down.

    ``environment(backend)`` gives variables to set first: a communication library
    reads some when its communicator starts (NCCL_ALGO, NCCL_PROTO; NCCL starts its
    communicators at the first collective, so an adopted group still reads them)."""
    adopted = dist.is_initialized()
    rank = dist.get_rank() if adopted else int(os.environ.get("RANK", 0))
    world_size = dist.get_world_size() if adopted else int(os.environ.get("WORLD_SIZE", 1))
    if adopted and world_size > 1 and "LOCAL_RANK" not in os.environ:
        local_rank, local_world_size = _place_on_host(rank, world_size)
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    torch_device = pick_device(device, local_rank)
    # auto in an adopted group: its own backend (a script's gloo group on a GPU).
    backend = _adopt_backend(backend) if adopted else resolve_backend(backend, torch_device.type)
    if environment is not None:
        os.environ.update(environment(backend))
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    # Ranks on one host share the cores it lets this process use (its CPU affinity);
    # oversubscribing them slows every rank.
    torch.set_num_threads(threads or max(1, len(available()) // local_world_size))
    if world_size > 1:
        settle_at_exit()
    if world_size > 1 and not adopted:
        dist.init_process_group(
            process_group_backend(backend),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=torch_device if torch_device.type == "cuda" else None,
        )
    return World(
        rank, world_size, local_rank, local_world_size, torch_device, backend, adopted, threads
    )


def _place_on_host(rank: int, world_size: int) -> tuple[int, int]:
    """(this rank's place among the ranks on its machine, how many there are) in a
    group the script started without LOCAL_RANK (mp.spawn's workers, one machine or
    several): from `this_machine` of every rank. The global rank is no GPU index on a
    second machine. Gathered on a gloo group of its own: the script's may be NCCL's,
    which carries no CPU objects."""
    group = dist.new_group(backend="gloo")
    hosts: list[Any] = [None] * world_size
    dist.all_gather_object(hosts, this_machine(), group=group)
    dist.destroy_process_group(group)
    mine = [r for r, host in enumerate(hosts) if host == hosts[rank]]
    return mine.index(rank), len(mine)


def _adopt_backend(wanted: str) -> str:
    """The adopted group's backend; an error when the scenario asked for another."""
    found = str(dist.get_backend())
    have = "nccl" if "nccl" in found else "gloo" if "gloo" in found else found
    if wanted != "auto" and have != wanted:
        raise GPUSetupError(
            f"this process already belongs to a process group on {found}, but the scenario "
            f"asks for {wanted}: set world.backend to {have} (or auto)"
        )
    return have


def close_world(world: World) -> None:
    """Tear the process group down once every rank is done with it (unless it was
    adopted: its owner does). Without the barrier, gloo aborted a finished rank now
    and then (2 of 16 torchrun runs): its peer was still talking to it, or the group
    outlived the interpreter."""
    if world.adopted:
        return
    if world.world_size > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        # Free the group now, while the interpreter is whole: left to the collector
        # at exit, a gloo worker thread still releasing the last collective's tensors
        # needs the GIL during finalization and aborts the process (seen in a core
        # dump: ~AsyncBarrierWork -> ~AsyncAllgatherWork -> take_gil -> terminate).
        gc.collect()


def all_gather_objects(obj: object, world: World) -> list[object]:
    if world.world_size == 1:
        return [obj]
    gathered: list[object] = [None] * world.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def all_reduce_sum(tensor: torch.Tensor, world: World) -> torch.Tensor:
    """``tensor`` summed across ranks (in place), on the device it lives on."""
    if world.world_size > 1:
        dist.all_reduce(tensor)
    return tensor
