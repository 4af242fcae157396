"""A script's list, tuple or range of batches as a loader with a position.

Such a sequence gives the same items in the same order every epoch, so the batches
handed out so far are all a resume needs: a run resumed mid-epoch goes on at the
next item, and one resumed at an epoch's end finishes that epoch (the script's own
end-of-epoch code, an evaluation or a learning rate annealed by hand, runs) rather
than start the next. A list the script changes between epochs (shuffled in place,
rebuilt) is noticed and said: a resumed script's list may hold other batches at the
same position.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

SEQUENCES = (list, tuple, range)


class SequenceLoader:
    """``items`` (a list, tuple or range) handed out one by one, counting them
    (``epoch``, ``position``: the items handed out in this epoch)."""

    def __init__(self, items: list[Any] | tuple[Any, ...] | range) -> None:
        self.items = items
        self.epoch = 0
        self.position = 0
        self.inexact_resume: str | None = None  # why a resume would not be exact, if so
        self._order: tuple[int, ...] | None = None  # a list's items, by identity

    def __iter__(self) -> Iterator[Any]:
        if self.position == 0:
            self._look_for_changes()
        while self.position < len(self.items):
            item = self.items[self.position]
            self.position += 1
            yield item
        self.next_epoch()

    def next_epoch(self) -> None:
        """The next pass is the next epoch: at this one's end, or when the pass was
        left before it (a ``break`` in the script's loop)."""
        self.epoch += 1
        self.position = 0

    def __len__(self) -> int:
        return len(self.items)

    @property
    def original(self) -> list[Any] | tuple[Any, ...] | range:
        """What the script gave `Session.prepare` (as a `ScriptLoader`'s)."""
        return self.items

    def _look_for_changes(self) -> None:
        if not isinstance(self.items, list) or self.inexact_resume is not None:
            return
        order = tuple(map(id, self.items))
        if self._order is not None and order != self._order:
            self.inexact_resume = (
                "cannot resume exactly: the script's list of batches changed between epochs "
                "(shuffled in place, or rebuilt): a resumed run goes on at its position in "
                "the list the resumed script has, which may hold other batches there. Pass "
                "a torch DataLoader (shuffle=True) to have the order drawn and resumed"
            )
        self._order = order

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "size": len(self.items)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        size = int(state.get("size", len(self.items)))
        if size != len(self.items):
            self.inexact_resume = (
                f"cannot resume exactly: the script's list of batches has {len(self.items)} "
                f"where the checkpointed run's had {size}: batch {self.position} of its "
                f"epoch {self.epoch} is another one now"
            )
