"""Mistral: LLaMA with a sliding window (`sliding_window`; longer rows are refused, `config.check_window`)."""

from __future__ import annotations

from transformers import PretrainedConfig

from .llama import decoder_config, llama_layout


def mistral_window(hf: PretrainedConfig) -> int | None:
    return getattr(hf, "sliding_window", None)


MISTRAL = llama_layout(("mistral",), "MistralForCausalLM", lambda hf: decoder_config(hf, window=mistral_window))
