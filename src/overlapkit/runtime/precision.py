"""Numeric precision of the training step: fp32, bf16 autocast, or fp16 with a grad scaler."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch

from .gpus import check_precision

PrecisionName = Literal["fp32", "bf16", "fp16"]


class Precision:
    def __init__(self, name: PrecisionName, device: torch.device) -> None:
        if name == "fp16" and device.type != "cuda":
            raise ValueError(
                "precision fp16 needs a CUDA device (its grad scaler is for GPUs); use bf16 on CPU"
            )
        if name == "bf16" and device.type == "cuda":
            check_precision(name, torch.cuda.get_device_capability(device))
        self.name = name
        self.device = device
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
        self.scaler = torch.amp.GradScaler("cuda") if name == "fp16" else None

    def autocast(self) -> AbstractContextManager[Any]:
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)
