"""Ministral 3 (`ministral3`, `Ministral3ForCausalLM`; the language model of the Ministral-3 releases, which wrap it in
`Mistral3ForConditionalGeneration`): Mistral (`mistral.py`: LLaMA's layout, `sliding_window` on every layer) with
Llama 4's attention scaling, each query after RoPE times 1 + beta * log(1 + floor(position / period)), beta being
`rope_parameters.llama_4_scaling_beta` and the period its `original_max_position_embeddings`
(`ModelConfig.query_scale_beta`)."""

from __future__ import annotations

from dataclasses import replace

from transformers import PretrainedConfig

from ..config import ModelConfig, require
from .llama import decoder_config, every_layer_window, llama_layout


def normalise(hf: PretrainedConfig) -> ModelConfig:
    params = getattr(hf, "rope_parameters", None) or {}
    beta, period = params.get("llama_4_scaling_beta"), params.get("original_max_position_embeddings")
    require(beta is not None, "rope_parameters.llama_4_scaling_beta", f"missing: {hf.model_type}'s attention scales "
            "its queries by it (transformers reads it unconditionally)")
    require(isinstance(period, int) and period >= 1, "rope_parameters.original_max_position_embeddings",
            f"{period!r}: the period of {hf.model_type}'s query scaling must be a positive integer")
    cfg = decoder_config(hf, window=every_layer_window)
    return replace(cfg, query_scale_beta=float(beta), query_scale_period=period)


MINISTRAL3 = llama_layout(("ministral3",), "Ministral3ForCausalLM", normalise)
