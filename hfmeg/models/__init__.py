"""The decoder model: TP/SP layers assembled into pipeline-stage chunks."""

from .build import build_chunk, build_chunk_from_hf, load_chunk_from_hf
from .decoder import ModelChunk

__all__ = ["ModelChunk", "build_chunk", "build_chunk_from_hf", "load_chunk_from_hf"]
