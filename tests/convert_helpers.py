"""Shared helpers of the conversion tests: source checkpoints and byte-level comparison."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from hfmeg.checkpoint.hf_reader import HFCheckpoint
from tiny_models import RANDOM_KINDS, STORIES, rewrite_config_v4, save_tiny

LAYOUTS = [(tp, pp) for tp in (1, 2, 4) for pp in (1, 2, 3)]


def make_sources(root: Path) -> dict[str, Path]:
    """Random tiny checkpoints with 4 layers (so PP=3 fits), plus stories260K when present."""
    out = {}
    for kind in RANDOM_KINDS:
        extra = {"layer_types": ["full_attention"] * 4} if kind in ("qwen2", "qwen3") else {}  # sized by layer
        if kind == "smollm3":  # the window on the NoPE layers
            extra.update(no_rope_layers=[1, 0, 1, 0], layer_types=["full_attention", "sliding_attention"] * 2)
        if kind in ("gemma2", "gemma3", "gemma4", "olmo3"):
            extra.update(layer_types=["sliding_attention", "full_attention"] * 2)
        out[kind] = save_tiny(kind, root / kind, num_hidden_layers=4, **extra)
    rewrite_config_v4(out["llama3"])
    if (STORIES / "config.json").is_file():
        out["stories260K"] = STORIES
    return out


def assert_same_tensors(src: Path, out: Path) -> int:
    """Every tensor of `src` is in `out` with the same name, dtype, shape and bytes (and nothing else)."""
    a, b = HFCheckpoint(src), HFCheckpoint(out)
    assert sorted(a.keys()) == sorted(b.keys())
    for name in a.keys():
        x, y = a.get(name), b.get(name)
        assert (x.dtype, x.shape) == (y.dtype, y.shape), name
        assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), name
    return len(a.keys())


def snapshot(folder: Path) -> dict[str, str]:
    """Path -> sha256 of every file under `folder` (to prove an input was not touched)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}
