"""OLMo 3 (`olmo3`, `Olmo3ForCausalLM`): OLMo 2 (`olmo2.py`) with a sliding window on the layers `layer_types`
marks (`llama.layer_types_window`) and RoPE per layer type (`rope_parameters` sliding_attention / full_attention,
as Gemma 3: `ModelConfig.rope_per_layer_type`)."""

from __future__ import annotations

from dataclasses import replace

from transformers import PretrainedConfig

from ..config import ModelConfig
from .llama import decoder_config, layer_types_window, llama_layout, rope_per_layer_type
from .olmo2 import olmo_switches


def normalise(hf: PretrainedConfig) -> ModelConfig:
    rope_per_layer_type(hf)
    cfg = olmo_switches(decoder_config(hf, window=layer_types_window, qk_norm=True))
    return replace(cfg, rope_per_layer_type=True)


OLMO3 = llama_layout(("olmo3",), "Olmo3ForCausalLM", normalise)
