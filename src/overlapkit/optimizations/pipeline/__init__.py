"""``pipeline``: pipeline-parallel stages (GPipe, 1F1B, interleaved, zero bubble)."""

from .optimization import Pipeline, PipelineError

__all__ = ["Pipeline", "PipelineError"]
