"""A `Session`'s arguments, checked before anything starts: a mistake is one
ValueError or TypeError that says what is allowed, not an error deep inside."""

from __future__ import annotations

import gc
import itertools
import operator
import sys
from collections.abc import Sequence
from typing import Any, get_args

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .arbitration import ArbitrationPolicy
from .hidden_modules import modules_out_of_sight, out_of_sight_message
from .optimization import Optimization
from .policies import POLICIES
from .precision import PrecisionName


def check_session_arguments(
    optimizations: Sequence[Any],
    policy: Any,
    device: Any,
    precision: Any,
    warmup_steps: Any,
    accumulate: Any,
) -> None:
    for given in optimizations:
        if isinstance(given, Optimization):
            continue
        if isinstance(given, str):
            raise TypeError(
                f"optimizations holds the name {given!r}: pass instances, e.g. "
                f"overlapkit.get_optimization({given!r})(intensity)"
            )
        if isinstance(given, type) and issubclass(given, Optimization):
            raise TypeError(
                f"optimizations holds the class {given.__name__}: pass an instance, "
                f"e.g. {given.__name__}(intensity)"
            )
        raise TypeError(f"optimizations holds {given!r}, not an overlapkit Optimization")
    if not isinstance(policy, ArbitrationPolicy) and policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
    if device != "auto" and not isinstance(device, torch.device):
        try:
            torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(
                f"device {device!r} is not a device: auto, cpu, cuda or cuda:N"
            ) from None
    if precision not in get_args(PrecisionName):
        raise ValueError(
            f"precision {precision!r} is not one of {', '.join(get_args(PrecisionName))}"
        )
    for name, value, least in (("warmup_steps", warmup_steps, 0), ("accumulate", accumulate, 1)):
        if not _at_least(value, least):
            raise ValueError(f"{name} must be a whole number of at least {least}, got {value!r}")


def check_total_steps(total_steps: Any) -> None:
    if not _at_least(total_steps, 0):
        raise ValueError(f"steps() takes a whole number of steps (0 or more), got {total_steps!r}")


def _at_least(value: Any, least: int) -> bool:
    """Whether ``value`` is a whole number (numpy's too, never a bool) of at least ``least``."""
    if isinstance(value, bool):
        return False
    try:
        return operator.index(value) >= least
    except TypeError:
        return False


ONE_MODEL = (
    "prepare() takes one model and its optimizer: the one whose optimizer.step() ends "
    "each step. Register the others for checkpointing instead, e.g. "
    "session.start(netD=netD, optimizerD=optimizerD)"
)


def check_prepare_arguments(model: Any, optimizer: Any, prepared: bool) -> None:
    """One model and one optimizer per session, prepared once."""
    if prepared:
        raise RuntimeError(f"prepare() was already called: {ONE_MODEL}")
    if _from_tensorflow(model) or _from_tensorflow(optimizer):
        raise TypeError(
            f"the Session API is torch-only, and got a Keras/TensorFlow "
            f"{type(model).__name__}: train TensorFlow models through a scenario with "
            "framework: tensorflow (overlapkit run SCENARIO)"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"{ONE_MODEL}; got {type(model).__name__} for the model")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{ONE_MODEL}; got {type(optimizer).__name__} for the optimizer")
    check_not_sharded(model, "the model")
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    check_optimizer_of(inner, optimizer)


def check_not_sharded(model: nn.Module, name: str) -> None:
    """overlapkit syncs gradients as DDP does, every rank holding the whole model. One
    split across ranks was broadcast part over part: FSDP's flat shards (one size on
    every rank) took rank 0's and the gradients FSDP had reduce-scattered were averaged
    across shards, silently; DTensor parameters (FSDP2's, tensor parallel's) failed in
    torch's dispatch (``c10d.broadcast_`` has no sharding strategy), and alone a
    checkpoint of them did."""
    sharded = _sharded_by(model)
    if sharded is not None:
        what, instead = sharded
        raise ValueError(
            f"{name} {what}: overlapkit syncs gradients as DDP does, every rank holding "
            f"the whole model, and cannot run one split across ranks; pass it {instead} "
            "(on several ranks overlapkit makes it data-parallel), or run this script "
            "without overlapkit"
        )


def _sharded_by(model: nn.Module) -> tuple[str, str] | None:
    """(what shards the model, how to pass it instead), or None. A model of FSDP's or
    with DTensors comes from modules the script imported: not imported, none can be
    (importing them here took 0.4 s)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    for module in model.modules() if fsdp is not None else ():
        if isinstance(module, fsdp.FullyShardedDataParallel):
            return "is wrapped in FullyShardedDataParallel (FSDP)", "unwrapped"
        if isinstance(module, fsdp.FSDPModule):
            return "is sharded by fully_shard (FSDP2)", "without fully_shard()"
    tensor = sys.modules.get("torch.distributed.tensor")
    held = itertools.chain(model.parameters(), model.buffers())
    if tensor is not None and any(isinstance(t, tensor.DTensor) for t in held):
        return (
            "has DTensor parameters (tensor parallel: parallelize_module)",
            "without parallelize_module()",
        )
    return None


def check_group_unchanged(world_size: int) -> None:
    """A process group the script started after the Session (``mp.spawn``'s workers
    have no RANK in their environment: the session found no group and runs as a rank
    of its own) would leave the ranks apart, each syncing nothing."""
    if not torch.distributed.is_initialized():
        return
    group_size = torch.distributed.get_world_size()
    if group_size != world_size:
        raise RuntimeError(
            f"this process joined a process group of {group_size} ranks after "
            f"overlapkit.Session() was made, which found none and runs on {world_size}: "
            "make the Session after dist.init_process_group() (under mp.spawn, in the "
            "worker function, after it starts the group)"
        )


def wrapped_in_ddp() -> set[int]:
    """The ids of the modules that live DistributedDataParallel wrappers hold, whole or
    as a part (a script's own, whose ``.module`` it registered): DDP marks neither, so
    its wrappers are looked for among the live objects, unreachable ones collected
    first (a few hundredths of a second). By type, not ``isinstance``: that reads a
    proxy's ``__class__`` (a dead weakref proxy raises)."""
    gc.collect()
    wrappers = [obj for obj in gc.get_objects() if issubclass(type(obj), DistributedDataParallel)]
    return {id(module) for ddp in wrappers for module in ddp.module.modules()}


def _from_tensorflow(value: Any) -> bool:
    return type(value).__module__.split(".")[0] in ("keras", "tensorflow", "tf_keras")


def check_optimizer_of(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """An optimizer over none of the model's parameters would train nothing, silently."""
    if optimizer is None:
        return
    mine = {id(p) for p in model.parameters()}
    theirs = [p for group in optimizer.param_groups for p in group["params"]]
    if theirs and not any(id(p) in mine for p in theirs):
        hidden = modules_out_of_sight(model)
        raise ValueError(
            "the optimizer holds none of the model's parameters (was it made for another "
            "model, or for a copy?): make it from model.parameters()"
            + (f"; {out_of_sight_message(hidden)}" if hidden else "")
        )
