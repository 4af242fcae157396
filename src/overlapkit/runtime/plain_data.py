"""Nested plain data (scenarios, setups, as JSON gives them): a value at a dotted
path, and the first difference between two, said in one phrase."""

from __future__ import annotations

from typing import Any


def first_difference(before: Any, after: Any, path: str = "") -> str | None:
    """``path.key before -> after`` for the first key (in sorted order, depth first)
    whose value differs; None when they are equal."""
    if before == after:
        return None
    if isinstance(before, dict) and isinstance(after, dict):
        for key in sorted(set(before) | set(after), key=str):
            found = first_difference(
                before.get(key), after.get(key), f"{path}.{key}" if path else str(key)
            )
            if found is not None:
                return found
    return f"{path or 'the scenario'} {_text(before)} -> {_text(after)}"


def _text(value: Any) -> str:
    return "unset" if value is None else str(value)


def value_at(data: Any, dotted: str) -> Any:
    """The value at ``a.b.c`` in nested mappings (None where a key is missing)."""
    for part in dotted.split("."):
        if not isinstance(data, dict):
            return None
        data = data.get(part)
    return data
