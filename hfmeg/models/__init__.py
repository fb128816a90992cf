"""The decoder model: TP/SP layers assembled into pipeline-stage chunks (weights are filled by `checkpoint.load`)."""

from .decoder import ModelChunk

__all__ = ["ModelChunk"]
