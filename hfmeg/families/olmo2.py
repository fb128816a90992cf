"""OLMo 2 (`olmo2`, `Olmo2ForCausalLM`): LLaMA's weight layout with the norms after each sublayer only,
`post_attention_layernorm` on the attention's output and `post_feedforward_layernorm` on the MLP's, none before
them (`ModelConfig.sandwich_norms` without `pre_norms`), and QK-norm over the whole q and k projections
(`self_attn.q_norm` of heads * head_dim, `k_norm` of kv_heads * head_dim: `ModelConfig.qk_norm_whole`), before RoPE."""

from __future__ import annotations

from dataclasses import replace
from transformers import PretrainedConfig

from ..config import ModelConfig
from .llama import decoder_config, llama_layout


def olmo_switches(cfg: ModelConfig) -> ModelConfig:
    return replace(cfg, sandwich_norms=True, pre_norms=False, qk_norm_whole=True)


def normalise(hf: PretrainedConfig) -> ModelConfig:
    return olmo_switches(decoder_config(hf, qk_norm=True))


OLMO2 = llama_layout(("olmo2",), "Olmo2ForCausalLM", normalise)
