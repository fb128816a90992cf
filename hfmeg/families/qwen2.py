"""Qwen2: LLaMA with biases on Q, K and V (not on the output projection); its sliding window is refused."""

from __future__ import annotations

from .llama import decoder_config, llama_layout, no_window

QWEN2 = llama_layout(("qwen2",), "Qwen2ForCausalLM",
                     lambda hf: decoder_config(hf, qkv_bias=True, out_bias=False, window=no_window))
