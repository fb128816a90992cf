"""Build a rank's model chunk straight from an HF checkpoint folder.

Each rank reads only the HF tensors its chunk needs, one at a time, and keeps only
its TP slice (`checkpoint.rules.to_local`). Shapes are checked against
`config.json` before any slicing, so a mismatched checkpoint fails with the tensor
name instead of a reshape error deep inside torch.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint.hf_reader import HFCheckpoint
from ..checkpoint.rules import chunk_rules, expected_hf_shape, to_local
from ..config import ModelConfig, load_hf_config, model_config_from_hf
from ..errors import CheckpointError
from ..parallel.state import ParallelState
from .decoder import ModelChunk


def load_chunk_from_hf(chunk: ModelChunk, ckpt: HFCheckpoint, vocab_multiple: int = 128) -> None:
    """Fill every parameter of `chunk` with its slice of the HF tensors."""
    cfg, ps = chunk.cfg, chunk.ps
    params = dict(chunk.named_parameters())
    rules = chunk_rules(cfg, chunk.layer_ids, chunk.pre_process, chunk.post_process)
    missing = set(params) - {r.local for r in rules}
    if missing:
        raise RuntimeError(f"no conversion rule for {sorted(missing)}")
    for rule in rules:
        tensors = []
        for j, name in enumerate(rule.hf):
            want = expected_hf_shape(rule, j, cfg)
            got = ckpt.shape(name)
            if tuple(got) != want:
                raise CheckpointError(
                    f"{ckpt.folder}: tensor {name} has shape {list(got)}, config.json implies {list(want)}"
                )
            tensors.append(ckpt.get(name))
        local = to_local(rule, tensors, cfg, ps.tp, ps.tp_rank, vocab_multiple)
        with torch.no_grad():
            params[rule.local].copy_(local)


def build_chunk_from_hf(folder: str | Path, ps: ParallelState, layers: range | None = None, **kwargs) -> ModelChunk:
    """A chunk (default: the whole model) of the HF checkpoint in `folder`, on `ps.device`.

    `kwargs` are `build_chunk`'s (pre_process, post_process, dtype, vocab_multiple, ModelChunk options).
    """
    return build_chunk(model_config_from_hf(load_hf_config(folder)), HFCheckpoint(folder), ps, layers, **kwargs)


def build_chunk(
    cfg: ModelConfig,
    ckpt: HFCheckpoint,
    ps: ParallelState,
    layers: range | None = None,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    dtype: torch.dtype = torch.float32,
    vocab_multiple: int = 128,
    **options,
) -> ModelChunk:
    """Layers `layers` (default: all) of `ckpt` as this rank's chunk, on `ps.device` in `dtype`.

    `options` go to `ModelChunk` (recompute, ce_chunk_tokens, compile_backend).
    """
    layers = range(cfg.num_layers) if layers is None else layers
    chunk = ModelChunk(
        cfg, ps, layers, pre_process=pre_process, post_process=post_process, vocab_multiple=vocab_multiple,
        **options,
    )
    load_chunk_from_hf(chunk, ckpt, vocab_multiple)
    return chunk.to(device=ps.device, dtype=dtype)
