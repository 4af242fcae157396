"""Hooks the session puts on the script's model and optimizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class SessionHook:
    """A hook of the session on the script's model or optimizer. A copy of the model
    (``torch.save(model)``, ``copy.deepcopy`` for an EMA copy) gets an inert hook in
    its place: not the session (which does not pickle), nor events from the copy."""

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.hook = hook

    def __call__(self, *args: Any) -> Any:
        return self.hook(*args)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_inert_hook, ())


def _inert_hook() -> Callable[..., None]:
    return _inert


def _inert(*args: Any) -> None:
    """What a copied model keeps in place of a session's hook."""
