"""A scenario's paths under ``--ray``: each machine's ranks run in the folder of the
Ray worker that starts them, not in the folder of the command, so a relative path
that the driver checked (``data.root``) or names (``log.tensorboard``) is made
absolute from here before the scenario travels. ``~`` in ``data.root`` stays: each
machine's home (the TensorBoard path's was expanded on the driver, when read)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def paths_from_here(scenario: Any) -> None:
    """Make ``scenario``'s relative paths absolute, from the current folder."""
    root = getattr(scenario.data, "root", None)
    if root is not None and _relative(root):
        scenario.data.root = Path(root).absolute()
    board = scenario.log.tensorboard
    if board is not None and _relative(board):
        scenario.log.tensorboard = str(Path(board).absolute())


def data_root_from_here(data: dict[str, Any]) -> dict[str, Any]:
    """A scenario as a dict (a tune trial's), its relative ``data.root`` made absolute
    from here. Only the text sent to the machines changes: the study compares trials
    by the scenario as written (a study begun without --ray goes on with it)."""
    root = (data.get("data") or {}).get("root")
    if root is None or not _relative(root):
        return data
    return {**data, "data": {**data["data"], "root": str(Path(root).absolute())}}


def _relative(path: str | Path) -> bool:
    return not (Path(path).is_absolute() or str(path).startswith("~"))
