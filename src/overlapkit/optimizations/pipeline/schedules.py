"""The schedules of ``torch.distributed.pipelining`` that a scenario can name, which
stages each rank holds under them, and the bubble they leave in theory."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduleKind:
    name: str
    torch_class: str
    multi: bool  # several stages per rank (a PipelineScheduleMulti)
    stages_per_rank: int | None = None  # fixed by the schedule, when it is
    min_microbatches: str = ""  # "ranks" or "stages": needs at least that many micro-batches
    help: str = ""
    # The first torch release it runs on. Before 2.11 gloo's send/recv under the
    # pipelining schedules fails or hangs here: 2.6 hangs a 1F1B step, 2.9 loses a
    # rank in the links' warm-up, 2.8 runs the one-stage-per-rank schedules but has
    # no Schedule.eval and sends a V schedule's same-rank hand-over to itself.
    torch_from: tuple[int, int] = (2, 11)

    def missing_in(self, torch_version: str) -> str | None:
        """Why this torch cannot run the schedule (None: it can)."""
        from torch.torch_version import TorchVersion

        if TorchVersion(torch_version) >= self.torch_from:
            return None
        major, minor = self.torch_from
        return (
            f"pipeline schedule {self.name} needs torch {major}.{minor} or later "
            f"(this is torch {torch_version}): on older releases torch's pipelining "
            "schedules fail or hang on their point-to-point sends; upgrade torch"
        )

    @property
    def cls(self) -> type:
        # Imported here: torch.distributed.pipelining takes seconds to import.
        from torch.distributed.pipelining import schedules as torch_schedules

        return getattr(torch_schedules, self.torch_class)

    def stage_ids(self, pp_rank: int, pp_size: int, per_rank: int) -> list[int]:
        """The global stage indices rank ``pp_rank`` holds, in order."""
        if self.name in ("zbv", "dualpipev"):  # V shape: stage r and its mirror image
            return [pp_rank, 2 * pp_size - 1 - pp_rank]
        return [pp_rank + k * pp_size for k in range(per_rank)]  # loop around the ranks

    def ideal_bubble(self, pp_size: int, microbatches: int, per_rank: int) -> float | None:
        """The idle fraction of a step with equal stages and free communication."""
        if self.name in ("gpipe", "1f1b"):
            return (pp_size - 1) / (microbatches + pp_size - 1)
        if self.name in ("interleaved_1f1b", "looped_bfs"):
            return (pp_size - 1) / (per_rank * microbatches + pp_size - 1)
        return None  # zero-bubble schedules: near 0 in theory, depends on the B/W split


SCHEDULES: dict[str, ScheduleKind] = {
    kind.name: kind
    for kind in (
        ScheduleKind("gpipe", "ScheduleGPipe", False, 1, help="all forwards, then all backwards"),
        ScheduleKind(
            "1f1b", "Schedule1F1B", False, 1, "ranks", "one forward, one backward (PipeDream-Flush)"
        ),
        ScheduleKind(
            "interleaved_1f1b",
            "ScheduleInterleaved1F1B",
            True,
            help="1F1B over several stages per rank (Megatron)",
        ),
        ScheduleKind("looped_bfs", "ScheduleLoopedBFS", True, help="breadth-first over stages"),
        ScheduleKind(
            "interleaved_zb",
            "ScheduleInterleavedZeroBubble",
            True,
            help="zero bubble: weight gradients fill the bubble",
        ),
        ScheduleKind("zbv", "ScheduleZBVZeroBubble", True, 2, help="zero bubble, V-shaped"),
        ScheduleKind(
            "dualpipev", "ScheduleDualPipeV", True, 2, "stages", help="DeepSeek DualPipeV"
        ),
    )
}
