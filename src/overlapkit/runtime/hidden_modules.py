"""Trainable state a model keeps where nn.Module does not look: modules or parameters
in a plain list, tuple or dict attribute (mnist_forward_forward's ``self.layers =
[Layer(...), ...]``), or a tensor that requires grad set as a plain attribute
(``self.scale = torch.ones(1, requires_grad=True)``). They are in neither
``model.parameters()`` nor ``model.state_dict()``, so a checkpoint of the model
misses them and no gradient sync sees them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

INSTEAD = {list: "ModuleList", tuple: "ModuleList", dict: "ModuleDict"}
OWN = ("_modules", "_parameters", "_buffers")  # nn.Module's registries


def modules_out_of_sight(model: nn.Module, seen_elsewhere: set[int] | None = None) -> list[str]:
    """Where ``model`` (or a module inside it) holds trainable modules or tensors out
    of nn.Module's sight, their parameters neither the model's nor in ``seen_elsewhere``
    (ids: a registered module's): one phrase each, ``"Net.layers (a list of 2 modules:
    use nn.ModuleList)"``."""
    seen = {id(p) for p in model.parameters()} | (seen_elsewhere or set())

    def unseen(tensor: Any) -> bool:
        return tensor.requires_grad and tensor.is_leaf and id(tensor) not in seen

    found = []
    for path, owner in model.named_modules():
        for name, value in vars(owner).items():
            where = ".".join(filter(None, [type(model).__name__, path, name]))
            if isinstance(value, torch.Tensor):  # (an nn.Parameter would be registered)
                if unseen(value) and not _recomputed(owner, name):
                    found.append(f"{where} (a tensor that requires grad: use nn.Parameter)")
                continue
            if type(value) not in INSTEAD or name in OWN:
                continue
            held = list(value.values() if isinstance(value, dict) else value)
            modules = [
                item
                for item in held
                if issubclass(type(item), nn.Module)  # (not a proxy's __class__)
                and any(unseen(p) for p in item.parameters())
            ]
            tensors = [t for t in held if issubclass(type(t), torch.Tensor) and unseen(t)]
            kind = type(value).__name__
            if modules:
                found.append(
                    f"{where} (a {kind} of {len(modules)} modules: use nn.{INSTEAD[type(value)]})"
                )
            if tensors:
                instead = INSTEAD[type(value)].replace("Module", "Parameter")
                found.append(f"{where} (a {kind} of {len(tensors)} tensors: use nn.{instead})")
    return found


def _recomputed(owner: nn.Module, name: str) -> bool:
    """Whether a forward pre-hook makes the attribute ``name`` anew from registered
    parameters before each forward (torch.nn.utils' weight_norm, spectral_norm and
    prune: ``weight`` from ``weight_g``/``weight_v`` or ``weight_orig``); a model
    pickled and loaded (torch.save of the whole model) holds it as a leaf."""
    hooks = owner._forward_pre_hooks.values()
    return any(name in (getattr(h, "name", None), getattr(h, "_tensor_name", None)) for h in hooks)


def out_of_sight_message(found: list[str]) -> str:
    return (
        f"the model keeps trainable modules or tensors where nn.Module does not see them: "
        f"{'; '.join(found)}. Their parameters are not in model.parameters() nor "
        "model.state_dict(): checkpoints miss their weights (a resume starts them "
        "afresh) and on several ranks their gradients are not averaged"
    )
