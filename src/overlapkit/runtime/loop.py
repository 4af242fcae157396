"""The built-in training loop that scenarios run, written on the `Session` API."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from ..config import Config
from .session import Session

# A rate or decay that no training survives (its NaN loss is soon there): one past a
# float32 (3.4e38), which the optimizer multiplies its tensors by, was an internal error.
MOST = 1_000_000
Beta = Annotated[float, Field(ge=0, lt=1)]  # as torch's Adam takes them


class OptimizerConfig(Config):
    name: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: float = Field(0.1, gt=0, le=MOST)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0, le=MOST)
    nesterov: bool = False
    betas: tuple[Beta, Beta] = (0.9, 0.999)


class LRScheduleConfig(Config):
    name: Literal["constant", "cosine", "linear", "step"] = "constant"
    warmup_steps: int = Field(0, ge=0)  # linear ramp from 0 (not the measurement warm-up)
    step_size: int = Field(30, ge=1)  # for "step"
    gamma: float = Field(0.1, gt=0)  # for "step"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)  # for "cosine" and "linear"


class EvalConfig(Config):
    every: int = Field(0, ge=0)  # evaluate every N steps; 0 = only at the end (if at_end)
    at_end: bool = False
    max_samples: int | None = Field(None, ge=1)


class TrainConfig(Config):
    batch_size: int = Field(32, ge=1)  # per rank
    steps: int = Field(50, ge=1)  # measured steps, after warm-up
    warmup_steps: int = Field(5, ge=0)
    accumulate: int = Field(1, ge=1)  # micro-batches of batch_size per optimizer step
    optimizer: OptimizerConfig = OptimizerConfig()
    lr_schedule: LRScheduleConfig = LRScheduleConfig()
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    eval: EvalConfig = EvalConfig()
    seed: int = Field(0, ge=0, lt=2**32)  # what every RNG seeded from it takes as it is
    deterministic: bool = False

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.optimizer.nesterov and (
            self.optimizer.name != "sgd" or not self.optimizer.momentum
        ):
            raise ValueError("optimizer.nesterov needs name: sgd and a momentum above 0")
        return self


def build_optimizer(
    cfg: OptimizerConfig, model: nn.Module, device: torch.device | None = None
) -> torch.optim.Optimizer:
    """On a GPU the fused step: one kernel per parameter group, and a grad scaler
    hands it the inf check on the device (the unfused step reads it on the host)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = {"fused": True} if device is not None and device.type == "cuda" else {}
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=cfg.lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            nesterov=cfg.nesterov,
            **fused,
        )
    cls = torch.optim.Adam if cfg.name == "adam" else torch.optim.AdamW
    return cls(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, **fused)


def lr_factor(cfg: LRScheduleConfig, total_steps: int) -> Callable[[int], float]:
    """The schedule: the learning rate's factor at each step (also what TensorFlow's
    loop tabulates, so both frameworks follow one schedule)."""
    warmup = cfg.warmup_steps
    decay_steps = max(1, total_steps - warmup)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / decay_steps)
        if cfg.name == "cosine":
            return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (
                1 + math.cos(math.pi * progress)
            )
        if cfg.name == "linear":
            return 1 - (1 - cfg.min_lr_ratio) * progress
        if cfg.name == "step":
            return cfg.gamma ** ((step - warmup) // cfg.step_size)
        return 1.0

    return factor


def build_lr_schedule(
    cfg: LRScheduleConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The schedule as a LambdaLR, or None for a constant rate (nothing to step)."""
    if cfg.name == "constant" and not cfg.warmup_steps:
        return None
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg, total_steps))


def train(
    cfg: TrainConfig,
    session: Session,
    model: nn.Module,
    train_loader: Any,
    eval_loader: Any = None,
    resume_from: Any = None,
) -> dict[str, Any]:
    """Train ``model`` for ``cfg.total_steps`` steps; return the run summary."""
    optimizer = build_optimizer(cfg.optimizer, model, session.world.device)
    lr_schedule = build_lr_schedule(cfg.lr_schedule, optimizer, cfg.total_steps)
    session.runs_a_script = False
    model, optimizer, _ = session.prepare(model, optimizer, train_loader, lr_schedule)
    if resume_from is not None:
        session.load(resume_from)
    evaluate_every = cfg.eval.every if eval_loader is not None else 0
    try:
        for inputs, targets in session.steps(cfg.total_steps):
            session.forward_backward(inputs, targets, F.cross_entropy)
            session.optimizer_step()
            if not session.state.is_sync_step:
                continue
            session.end_step()
            if evaluate_every and session.state.step % evaluate_every == 0:
                session.evaluate(eval_loader)
        last = session.state.eval_results[-1]["step"] if session.state.eval_results else None
        if eval_loader is not None and cfg.eval.at_end and last != session.state.step:
            session.evaluate(eval_loader)
    except BaseException:
        session.stopped()  # the progress bar and the step logs closed, not left to the GC
        raise
    return session.finish()
