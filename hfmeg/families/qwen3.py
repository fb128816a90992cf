"""Qwen3 (dense): LLaMA with RMSNorm over each query and key head before RoPE (QK-norm), `attention_bias` for
all four projections, `head_dim` of its own (often not hidden / heads).

Its sliding window is per layer (`layer_types`, from `use_sliding_window` and `max_window_layers`): a window
on every layer is Mistral's (rows longer than it refused, `config.check_window`); a window on some layers
only is refused, naming `layer_types`, until hfmeg runs per-layer windows."""

from __future__ import annotations

from transformers import PretrainedConfig

from ..config import require
from .llama import decoder_config, llama_layout


def layer_window(hf: PretrainedConfig) -> int | None:
    """The window when `layer_types` puts it on every layer, None on none; refuses a window on some layers only."""
    window = getattr(hf, "sliding_window", None)  # transformers sets it to None without use_sliding_window
    types = list(getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers)
    require(set(types) <= {"full_attention", "sliding_attention"}, "layer_types",
            f"{sorted(set(types) - {'full_attention', 'sliding_attention'})} are not supported")
    windowed = [i for i, t in enumerate(types) if t == "sliding_attention"] if window is not None else []
    require(len(windowed) in (0, len(types)), "layer_types",
            f"a sliding window on layers {windowed} only: per-layer windows are not supported")
    return window if windowed else None


QWEN3 = llama_layout(("qwen3",), "Qwen3ForCausalLM", lambda hf: decoder_config(hf, window=layer_window, qk_norm=True))
