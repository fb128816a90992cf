"""OLMo 2 (`olmo2`, `Olmo2ForCausalLM`): LLaMA's weight layout with the norms after each sublayer only,
`post_attention_layernorm` on the attention's output and `post_feedforward_layernorm` on the MLP's, none before
them (`ModelConfig.sandwich_norms` without `pre_norms`), and QK-norm over the whole q and k projections
(`self_attn.q_norm` of heads * head_dim, `k_norm` of kv_heads * head_dim: `ModelConfig.qk_norm_whole`), before RoPE."""

from __future__ import annotations

from dataclasses import replace
from typing import Collection

from transformers import PretrainedConfig

from ..config import ModelConfig
from .llama import PROJECTIONS, decoder_config, layer_prefix, layer_rules
from .spec import FamilySpec, PeftNames, TensorRule


def olmo_switches(cfg: ModelConfig) -> ModelConfig:
    return replace(cfg, sandwich_norms=True, pre_norms=False, qk_norm_whole=True)


def normalise(hf: PretrainedConfig) -> ModelConfig:
    return olmo_switches(decoder_config(hf, qk_norm=True))


def olmo_rules(cfg: ModelConfig, i: int, experts: Collection[int]) -> list[TensorRule]:
    """LLaMA's rules without the pre-norms, with the two output norms."""
    p, L = layer_prefix(i), f"layers.{i}."
    return layer_rules(cfg, i, experts) + [
        TensorRule(L + "attn_out_norm.weight", (p + "post_attention_layernorm.weight",), "replicated"),
        TensorRule(L + "mlp_out_norm.weight", (p + "post_feedforward_layernorm.weight",), "replicated"),
    ]


def olmo_layout(model_types: tuple[str, ...], architecture: str, normalise) -> FamilySpec:
    return FamilySpec(model_types, architecture, normalise, olmo_rules, embedding="model.embed_tokens.weight",
                      final_norm="model.norm", peft=PeftNames(PROJECTIONS))


OLMO2 = olmo_layout(("olmo2",), "Olmo2ForCausalLM", normalise)
