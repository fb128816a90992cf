"""This rank's pipeline stage: its model chunks, built from an HF folder for a layout.

The chunks are the ones `layout.split_layers` assigns to this pipeline rank (one
per virtual stage, in virtual order), each holding only this TP rank's slices.
With tied embeddings the last stage's `lm_head` is filled from the embedding
tensor by the conversion rules, so both copies start equal.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint.hf_reader import HFCheckpoint
from ..config import load_hf_config, model_config_from_hf
from ..models import ModelChunk, build_chunk
from .layout import rank_chunks, split_layers
from .state import ParallelState


def build_stage_from_hf(
    folder: str | Path,
    ps: ParallelState,
    *,
    pp_layers: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
    vocab_multiple: int = 128,
    **options,
) -> list[ModelChunk]:
    """This rank's chunks (virtual order) of the checkpoint in `folder` for the layout `ps`.

    `options` go to `ModelChunk` (recompute, ce_chunk_tokens, compile_backend).
    """
    cfg = model_config_from_hf(load_hf_config(folder))
    ckpt = HFCheckpoint(folder)
    specs = rank_chunks(split_layers(cfg.num_layers, ps.pp, ps.vpp, pp_layers), ps.pp_rank)
    return [
        build_chunk(cfg, ckpt, ps, spec.layers, pre_process=spec.pre_process, post_process=spec.post_process,
                    dtype=dtype, vocab_multiple=vocab_multiple, **options)
        for spec in specs
    ]
