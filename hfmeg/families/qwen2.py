"""Qwen2: LLaMA with biases on Q, K and V (not on the output projection); its sliding window is per layer
(`layer_types`, from `use_sliding_window` and `max_window_layers`: `llama.layer_types_window`)."""

from __future__ import annotations

from .llama import decoder_config, layer_types_window, llama_layout

QWEN2 = llama_layout(("qwen2",), "Qwen2ForCausalLM",
                     lambda hf: decoder_config(hf, qkv_bias=True, out_bias=False, window=layer_types_window))
