"""Modules a model keeps where nn.Module does not look: in a plain list, tuple or dict
attribute (mnist_forward_forward's ``self.layers = [Layer(...), ...]``). Their
parameters are in neither ``model.parameters()`` nor ``model.state_dict()``, so a
checkpoint of the model misses them and no gradient sync sees them."""

from __future__ import annotations

from torch import nn

INSTEAD = {list: "nn.ModuleList", tuple: "nn.ModuleList", dict: "nn.ModuleDict"}


def modules_out_of_sight(model: nn.Module, seen_elsewhere: set[int] | None = None) -> list[str]:
    """Where ``model`` (or a module inside it) holds trainable modules in a plain
    container, their parameters neither the model's nor in ``seen_elsewhere`` (ids: a
    registered module's): one phrase each, ``"Net.layers (a list of 2 modules: use
    nn.ModuleList)"``."""
    seen = {id(p) for p in model.parameters()} | (seen_elsewhere or set())
    found = []
    for owner in model.modules():
        for name, value in vars(owner).items():
            if type(value) not in INSTEAD or name in ("_modules", "_parameters", "_buffers"):
                continue
            held = value.values() if isinstance(value, dict) else value
            hidden = [
                item
                for item in held
                if issubclass(type(item), nn.Module)  # (not a proxy's __class__)
                and any(p.requires_grad and id(p) not in seen for p in item.parameters())
            ]
            if hidden:
                found.append(
                    f"{type(owner).__name__}.{name} (a {type(value).__name__} of "
                    f"{len(hidden)} modules: use {INSTEAD[type(value)]})"
                )
    return found


def out_of_sight_message(found: list[str]) -> str:
    return (
        f"the model keeps trainable modules where nn.Module does not see them: "
        f"{'; '.join(found)}. Their parameters are not in model.parameters() nor "
        "model.state_dict(): checkpoints miss their weights (a resume starts them "
        "afresh) and on several ranks their gradients are not averaged"
    )
