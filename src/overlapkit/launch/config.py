"""The ``world`` section of a scenario: how many ranks, where, on what."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..config import Config


class WorldConfig(Config):
    nprocs: int = Field(1, ge=1)  # ranks per machine (ignored under torchrun, which sets its own)
    nodes: int = Field(1, ge=1)  # machines: more than one needs --ray, or --node-rank on each
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on CUDA, gloo on CPU
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int | None = Field(None, ge=1)  # per rank; default: cores / local ranks
    timeout_s: float = Field(300.0, gt=0, allow_inf_nan=False)  # for a peer to arrive or answer

    @property
    def ranks(self) -> int:
        return self.nodes * self.nprocs
