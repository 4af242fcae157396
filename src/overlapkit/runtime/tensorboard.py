"""TensorBoard, for users who compare runs there: rank 0's steps as scalars
(loss, samples/s, step time and each phase, per step), the run's setting as
text, written with torch's SummaryWriter (the ``tensorboard`` package, the
``overlapkit[tensorboard]`` extra)."""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import field_validator

from ..config import Config
from ..packages import installed
from .optimization import Optimization, settings_on


class LogConfig(Config):
    # A folder for TensorBoard's event files (per-step loss, throughput and phase
    # times); a study writes each trial's run in a folder of its own under it.
    tensorboard: str | None = None

    @field_validator("tensorboard")
    @classmethod
    def _home(cls, folder: str | None) -> str | None:
        """``~`` is the home folder, as in checkpoint.dir and data.root (a folder named
        ``~`` was made in the current one)."""
        try:
            return None if folder is None else str(Path(folder).expanduser())
        except RuntimeError as error:  # ~user of no such user, or no home folder
            raise ValueError(f"{folder}: {error}") from None


def tensorboard_missing() -> str | None:
    """Why TensorBoard's event files cannot be written here, or None."""
    if installed("tensorboard"):
        return None
    return (
        "log.tensorboard needs the tensorboard package, which is not installed: "
        "pip install 'overlapkit[tensorboard]'"
    )


def _without_tensorflow() -> None:
    """Let TensorBoard write its event files with its own stub of TensorFlow's file
    API: where TensorFlow is installed but not in use, SummaryWriter imported it
    (3.7 s of a 2-core machine per run, and TensorFlow's start-up lines on stderr).
    ``tensorboard.compat.notf`` is the module TensorBoard's own no-TensorFlow build
    provides to choose the stub."""
    if "tensorflow" not in sys.modules:
        sys.modules.setdefault(
            "tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf")
        )


class TensorBoardSteps:
    """Writes each finished step (the same records as ``steps.jsonl``) as scalars, and
    the run's setting (its optimizations' knobs on ``framework``, the policy) as text."""

    def __init__(
        self,
        folder: str | Path,
        optimizations: Iterable[Optimization],
        framework: str,
        policy: str,
    ) -> None:
        _without_tensorflow()
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(folder))
        setting: dict[str, Any] = {o.name: settings_on(o, framework) for o in optimizations}
        setting["scheduler"] = {"policy": policy}
        text = json.dumps(setting, indent=2, default=str)
        self._writer.add_text("setting", f"```\n{text}\n```", 0)

    def write(self, record: dict[str, Any], samples_per_s: float) -> None:
        step, add = record["step"], self._writer.add_scalar
        if isinstance(record.get("loss"), (int, float)):
            add("train/loss", record["loss"], step)
        add("train/samples_per_s", samples_per_s, step)  # all replicas together
        add("train/step_time_ms", record["step_time_s"] * 1e3, step)
        for phase, seconds in record["phases_s"].items():
            add(f"phases_ms/{phase}", seconds * 1e3, step)

    def close(self) -> None:
        self._writer.close()
