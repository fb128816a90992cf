"""Build a rank's model chunks from an MP checkpoint (what the trainer and tools load).

A rank opens only its own rank file (`mp_rank_TT[_PPP]/model.safetensors`) and
copies each tensor into the matching parameter of its virtual chunks; names are
the chunks' own parameter names, so there is no conversion at load time. The
layout must be the run's layout: a checkpoint saved with another TP/PP/VPP is
refused with a LayoutError that says how to reshard it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import CheckpointError, LayoutError
from ..models.decoder import ModelChunk
from ..parallel.state import ParallelState
from .mp_layout import DTYPES, MPLayout
from .mp_reader import MPCheckpoint
from .rules import chunk_rules


def check_layout(layout: MPLayout, ps: ParallelState, where: Path) -> None:
    saved, run = (layout.tp, layout.pp, layout.vpp), (ps.tp, ps.pp, ps.vpp)
    if saved != run:
        raise LayoutError(
            f"{where}: saved with TP={saved[0]} PP={saved[1]} VPP={saved[2]}, but this run uses "
            f"TP={run[0]} PP={run[1]} VPP={run[2]}; reshard it with tools/reshard_mp.py --mp {where} --out NEW "
            f"--tp {run[0]} --pp {run[1]} --vpp {run[2]} (a training checkpoint keeps its optimizer, step and data "
            "position: then resume from NEW's iteration folder)"
        )


def default_dtype(layout: MPLayout) -> torch.dtype:
    by_name = {str(d).removeprefix("torch."): d for d in DTYPES.values()}
    return by_name.get(layout.dtype, torch.float32)


def load_chunks_from_mp(
    mp_dir: str | Path,
    ps: ParallelState,
    *,
    iteration: int | None = None,
    dtype: torch.dtype | None = None,
    **options,
) -> list[ModelChunk]:
    """This rank's chunks in virtual-chunk order (chunk v is model chunk v * pp + pp_rank).

    `dtype` defaults to the checkpoint's dtype (float32 when it is mixed); `options`
    go to `ModelChunk` (recompute, ce_chunk_tokens, ...).
    """
    ckpt = MPCheckpoint(mp_dir, iteration)
    layout, cfg = ckpt.layout, ckpt.cfg
    check_layout(layout, ps, ckpt.folder)
    dtype = dtype or default_dtype(layout)
    chunks = []
    for spec in layout.rank_chunks(ps.pp_rank):
        chunk = ModelChunk(cfg, ps, spec.layers, pre_process=spec.pre_process, post_process=spec.post_process,
                           vocab_multiple=layout.vocab_multiple, **options)
        params = dict(chunk.named_parameters())
        rules = chunk_rules(cfg, spec.layers, spec.pre_process, spec.post_process)
        if set(params) != {r.local for r in rules}:
            raise CheckpointError(f"{ckpt.folder}: chunk {spec.index} parameters do not match the conversion rules")
        with torch.no_grad():
            for rule in rules:
                params[rule.local].copy_(ckpt.local(ps.tp_rank, ps.pp_rank, rule.local))
        chunks.append(chunk.to(device=ps.device, dtype=dtype))
    return chunks
