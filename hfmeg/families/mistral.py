"""Mistral: LLaMA with a sliding window on every layer (`sliding_window`, `llama.every_layer_window`)."""

from __future__ import annotations

from .llama import decoder_config, every_layer_window, llama_layout

MISTRAL = llama_layout(("mistral",), "MistralForCausalLM", lambda hf: decoder_config(hf, window=every_layer_window))
