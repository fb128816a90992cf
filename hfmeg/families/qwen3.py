"""Qwen3 (dense): LLaMA with RMSNorm over each query and key head before RoPE (QK-norm), `attention_bias` for
all four projections, `head_dim` of its own (often not hidden / heads).

Its sliding window is per layer (`layer_types`, from `use_sliding_window` and `max_window_layers`:
`llama.layer_types_window`)."""

from __future__ import annotations

from .llama import decoder_config, layer_types_window, llama_layout

QWEN3 = llama_layout(("qwen3",), "Qwen3ForCausalLM",
                     lambda hf: decoder_config(hf, window=layer_types_window, qk_norm=True))
