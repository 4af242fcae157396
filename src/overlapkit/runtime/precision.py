"""Numeric precision of the training step: fp32, bf16 autocast, or fp16 with a grad scaler."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch

from .gpus import GPUFacts, check_build, check_precision

PrecisionName = Literal["fp32", "bf16", "fp16"]


def scaler_wait_note(optimizer: torch.optim.Optimizer) -> str | None:
    """Why fp16's grad scaler would make every step wait for the GPU with ``optimizer``
    (None: it would not). A fused optimizer takes the scaler's inf check on the device;
    any other has `GradScaler.step` read it on the host (``.item()``) each step."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        return None
    return (
        f"fp16: the optimizer ({type(optimizer).__name__}) is not fused, so the grad "
        "scaler reads its inf check on the host at every step: the host waits for the GPU "
        "and cannot queue the next step ahead. Build it with fused=True (torch's SGD, Adam "
        "and AdamW take it) to keep the step on the device"
    )


class Precision:
    def __init__(self, name: PrecisionName, device: torch.device) -> None:
        if name == "fp16" and device.type != "cuda":
            raise ValueError(
                "precision fp16 needs a CUDA device (its grad scaler is for GPUs); use bf16 on CPU"
            )
        if device.type == "cuda":
            # A script's Session gets the scenario's checks too: kernels for this GPU
            # ("no kernel image" at the first step otherwise), bf16 where it is real.
            check_build(GPUFacts.probe())
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
        """The grad scaler's state, its scale and growth tracker as device tensors:
        `GradScaler.state_dict` reads them with ``.item()``, which would make every
        checkpoint wait for the GPU. Copies, since the next ``update`` changes them
        in place; the snapshot takes them to the host in stream order."""
        scaler = self.scaler
        if scaler is None:
            return {}
        if scaler._scale is None or scaler._growth_tracker is None:
            return scaler.state_dict()  # before the first step: plain numbers, no read
        return {
            "scale": scaler._scale.detach().clone(),
            "growth_factor": scaler.get_growth_factor(),
            "backoff_factor": scaler.get_backoff_factor(),
            "growth_interval": scaler.get_growth_interval(),
            "_growth_tracker": scaler._growth_tracker.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler and state:
            numbers = {"scale": float, "_growth_tracker": int}  # tensors when saved by us
            self.scaler.load_state_dict(
                {k: numbers[k](v) if k in numbers else v for k, v in state.items()}
            )
