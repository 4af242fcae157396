"""``ddp_overlap`` on TensorFlow: the same knobs, as MultiWorkerMirroredStrategy's
communication options.

``bucket_cap_mb`` becomes ``bytes_per_pack``: the strategy groups gradients, in
reverse, into packs of that size, one collective each, and a pack's all-reduce
starts as soon as its gradients exist, while backward goes on. Mode
``no_overlap`` (intensity 0) is ``bytes_per_pack=0``: one pack, after backward.
(TensorFlow 2.21 implements no automatic pack size: 0 means one.)
"""

from __future__ import annotations

from typing import Any

from ...runtime.optimization import settings_on
from .optimization import DDPOverlap

MiB = 1 << 20


class TfCommunication:
    """What the strategy is built with, and what the run showed of it."""

    name = DDPOverlap.name

    def __init__(self, optimization: DDPOverlap) -> None:
        self.optimization = optimization
        settings = optimization.settings
        overlap = settings["mode"] == "overlap"
        self.bytes_per_pack = int(settings["bucket_cap_mb"] * MiB) if overlap else 0
        self.implementation = settings["implementation"]

    def communication_options(self) -> dict[str, Any]:
        return {"bytes_per_pack": self.bytes_per_pack, "implementation": self.implementation}

    def shown_settings(self, device: str) -> dict[str, Any]:
        """The settings as they run: ``implementation: auto`` is the ring on a CPU (NCCL
        needs GPUs); on GPUs TensorFlow chooses when the collectives run."""
        shown = settings_on(self.optimization, "tensorflow")
        if shown["implementation"] == "auto":
            shown["implementation"] = (
                "auto (ring: no GPUs)" if device != "cuda" else "auto (TensorFlow's choice)"
            )
        return shown

    def summary(self, run: dict[str, Any]) -> dict[str, Any]:
        strategy = run.get("strategy", {})
        section = {
            **self.shown_settings(strategy.get("device", "cpu")),
            "bytes_per_pack": self.bytes_per_pack,
            "packs_per_step": strategy.get("allreduce_packs_per_step"),
            "comm_exposed_s": run["phases_s"]["comm_exposed"],
        }
        if notes := self.no_overlap_notes(strategy):
            section["notes"] = notes
        return section

    def no_overlap_notes(self, strategy: dict[str, Any]) -> list[str]:
        """Why the packs could not overlap backward in this run, when they could not
        (mode overlap, several workers)."""
        if not self.bytes_per_pack or strategy.get("replicas", 1) < 2:
            return []
        notes = []
        packs = strategy.get("allreduce_packs_per_step")
        if packs == 1:
            notes.append(
                f"one pack per step: the gradients fit in one of {self.bytes_per_pack / MiB:g} "
                "MiB (bucket_cap_mb), so their all-reduce runs after backward, as at "
                "intensity 0; a smaller bucket_cap_mb splits them"
            )
        elif packs and strategy.get("inter_op_threads") == 1:
            notes.append(
                f"{packs} packs, but one inter-op thread per worker (the cores shared among "
                "the workers): TensorFlow ran their all-reduces after backward, not beside "
                "it; world.threads: 2 gives each worker a second"
            )
        return notes


def engine(optimization: DDPOverlap) -> TfCommunication:
    return TfCommunication(optimization)
