"""A model as an ordered list of named layers, and a stage made of some of them.

A model can be split when it is an ``nn.Sequential`` or defines
``pipeline_layers()`` returning ``[(name, module), ...]`` whose composition, in
order, is its forward pass. A layer takes the previous layer's output (a
tuple is unpacked into arguments) and returns the next one's input.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class SplitError(ValueError):
    """The model cannot be split as asked."""


def sequential_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    if isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's wrapper
        raise SplitError(
            f"pipeline cannot split a torch.compile'd {type(model._orig_mod).__name__}: its "
            "stages are new modules, so the compiled graph would not run; pass the model "
            "uncompiled"
        )
    if hasattr(model, "pipeline_layers"):
        layers = list(model.pipeline_layers())
    elif isinstance(model, nn.Sequential):
        layers = list(model.named_children())
    else:
        raise SplitError(
            f"pipeline cannot split {type(model).__name__}: it needs an nn.Sequential or a "
            "model with pipeline_layers() returning [(name, module), ...] in forward order"
        )
    if not layers:
        raise SplitError(f"{type(model).__name__} has no layers to split")
    return layers


def run_layers(layers: Any, x: Any) -> Any:
    for layer in layers:
        x = layer(*x) if isinstance(x, tuple) else layer(x)
    return x


def tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(v) for v in value)
    return 0


class StageModule(nn.Module):
    """Consecutive layers of a model, run in order: one pipeline stage.

    Parameter names are the model's own, with dots in a layer's name turned into
    underscores (``layer1.0.conv1.weight`` becomes ``layers.layer1_0.conv1.weight``).
    Counts the bytes that come in, for the activation traffic.
    """

    def __init__(self, layers: list[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self.names = [name for name, _ in layers]
        self.layers = nn.ModuleDict({name.replace(".", "_"): module for name, module in layers})
        self.bytes_in = 0

    def forward(self, *inputs: Any) -> Any:
        self.bytes_in += tensor_bytes(inputs)
        return run_layers(self.layers.values(), inputs if len(inputs) > 1 else inputs[0])
