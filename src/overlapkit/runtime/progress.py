"""The progress bar of a run: steps done, throughput, time left (on stderr, rank 0 only)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class ProgressBar:
    @staticmethod
    def wanted() -> bool:
        """Draw only on a terminal: piped or captured output stays clean."""
        return Console(stderr=True).is_terminal

    def __init__(
        self, description: str, total: int, done: int = 0, console: Console | None = None
    ) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]:>10.1f} samples/s"),
            TextColumn("loss {task.fields[loss]:.4f}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console or Console(stderr=True),
            refresh_per_second=4,
            transient=False,
        )
        self._task = self._progress.add_task(
            description, total=total, completed=done, rate=0.0, loss=float("nan")
        )
        self._progress.start()
        self._rate = 0.0

    def advance(self, samples_per_s: float, loss: float | None, warmup: bool) -> None:
        # An exponential average keeps the displayed rate readable.
        self._rate = samples_per_s if self._rate == 0 else 0.8 * self._rate + 0.2 * samples_per_s
        description = "warm-up" if warmup else "training"
        self._progress.update(
            self._task,
            advance=1,
            rate=self._rate,
            loss=float("nan") if loss is None else loss,  # a rank that computes no loss
            description=description,
        )

    def close(self) -> None:
        self._progress.stop()
