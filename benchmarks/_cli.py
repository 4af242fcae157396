"""What every benchmark's command line shares: its --help text and its counts' checks."""

from __future__ import annotations

import argparse


def description(doc: str | None) -> str:
    """The module docstring's first paragraph (its first line alone can stop mid-sentence)."""
    return (doc or "").split("\n\n")[0]


def positive_int(text: str) -> int:
    """An argparse type for counts (steps, rounds, repeats): a whole number, at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is too small: at least 1")
    return value


def csv_choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    """A comma-separated list, each item one of ``allowed`` (raises ValueError otherwise)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if unknown := [item for item in items if item not in allowed]:
        raise ValueError(f"{flag}: unknown {', '.join(unknown)}: choose from {', '.join(allowed)}")
    if not items:
        raise ValueError(f"{flag}: empty: choose from {', '.join(allowed)}")
    return items
