"""Gemma 3 text (`gemma3_text`, `Gemma3ForCausalLM`): Gemma 2's layout and switches (`gemma2.gemma_switches`) with
QK-norm ((1 + w) RMSNorm over each query and key head, `self_attn.q_norm`/`k_norm`) and RoPE per layer type: the
sliding layers rotate with `rope_parameters["sliding_attention"]` (`rope_local_base_freq`), the full layers with
`rope_parameters["full_attention"]` (`rope_theta` and `rope_scaling`), as transformers normalises them
(`ModelConfig.rope_per_layer_type`). transformers' Gemma 3 attention does not apply `attn_logit_softcapping`
(its field is read and unused, transformers 5.x), so neither does hfmeg: the final logits are soft-capped."""

from __future__ import annotations

from dataclasses import replace

from transformers import PretrainedConfig

from ..config import ModelConfig
from .gemma2 import ACT_FIELD, gemma_switches
from .llama import decoder_config, layer_types_window, llama_layout, rope_per_layer_type


def normalise(hf: PretrainedConfig) -> ModelConfig:
    rope_per_layer_type(hf)
    cfg = gemma_switches(hf, decoder_config(hf, window=layer_types_window, qk_norm=True, act_field=ACT_FIELD))
    return replace(cfg, rope_per_layer_type=True, attn_softcap=None)


GEMMA3 = llama_layout(("gemma3_text",), "Gemma3ForCausalLM", normalise)
