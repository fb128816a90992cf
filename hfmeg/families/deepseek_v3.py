"""DeepSeek-V3 (`deepseek_v3`, `DeepseekV3ForCausalLM`): multi-head latent attention (`ModelConfig.mla`,
`models/latent_attention.py`) in every layer, a dense SwiGLU MLP in the first `first_k_dense_replace` layers.

MLA's tensors: `self_attn.q_a_proj` and `kv_a_proj_with_mqa` and their norms are whole on every TP rank, `q_b_proj`
(or `q_proj` without a query latent) and `kv_b_proj` split by rows (whole heads), `o_proj` by columns.

Multi-token prediction: transformers (5.24) builds no MTP module and skips a checkpoint's MTP layers
(`model.layers.{num_hidden_layers}.*`) on load; hfmeg computes what transformers computes, so it neither reads nor
trains nor writes them, whatever `num_nextn_predict_layers` says (docs/numerics.md).

Not built, refused by their field: the MoE layers (`first_k_dense_replace` below `num_hidden_layers`) and biases
on the attention projections (`attention_bias`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Collection

from transformers import PretrainedConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

from ..config import MLAConfig, ModelConfig, require
from .llama import decoder_config, layer_prefix
from .spec import FamilySpec, TensorRule


def _mla(hf: PretrainedConfig) -> MLAConfig:
    qk = hf.qk_nope_head_dim + hf.qk_rope_head_dim
    require(hf.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", f"{hf.qk_rope_head_dim}: RoPE rotates pairs (use an even size)")
    return MLAConfig(q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=hf.qk_nope_head_dim,
                     qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
                     rope_interleave=bool(hf.rope_interleave),
                     softmax_scale=yarn_apply_mscale(hf.rope_parameters, qk ** -0.5))


def normalise(hf: PretrainedConfig) -> ModelConfig:
    require(not hf.attention_bias, "attention_bias", f"{hf.attention_bias!r}: biases on {hf.model_type}'s attention "
            "projections are not supported (use false)")
    heads = hf.num_attention_heads
    require(hf.num_key_value_heads == heads, "num_key_value_heads", f"{hf.num_key_value_heads}: MLA expands its keys "
            f"and values to every head (use num_attention_heads={heads})")
    dense = hf.first_k_dense_replace
    layers = hf.num_hidden_layers
    require(dense is not None and dense >= layers, "first_k_dense_replace", f"{dense}: {hf.model_type}'s MoE layers "
            f"are not supported yet (use num_hidden_layers={layers}: every layer dense)")
    mla = _mla(hf)
    cfg = decoder_config(hf)
    return replace(cfg, num_kv_heads=heads, head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla=mla)


def _attention_rules(cfg: ModelConfig, i: int) -> list[TensorRule]:
    m, h, heads = cfg.mla, cfg.hidden_size, cfg.num_heads
    a, L = layer_prefix(i) + "self_attn.", f"layers.{i}.attn."
    q_out = heads * cfg.head_dim
    if m.q_lora_rank is None:
        rules = [TensorRule(L + "q.weight", (a + "q_proj.weight",), "rows", shapes=((q_out, h),))]
    else:
        r = m.q_lora_rank
        rules = [TensorRule(L + "q_a.weight", (a + "q_a_proj.weight",), "replicated", shapes=((r, h),)),
                 TensorRule(L + "q_a_norm.weight", (a + "q_a_layernorm.weight",), "replicated", shapes=((r,),)),
                 TensorRule(L + "q_b.weight", (a + "q_b_proj.weight",), "rows", shapes=((q_out, r),))]
    r = m.kv_lora_rank
    return rules + [
        TensorRule(L + "kv_a.weight", (a + "kv_a_proj_with_mqa.weight",), "replicated",
                   shapes=((r + m.qk_rope_head_dim, h),)),
        TensorRule(L + "kv_a_norm.weight", (a + "kv_a_layernorm.weight",), "replicated", shapes=((r,),)),
        TensorRule(L + "kv_b.weight", (a + "kv_b_proj.weight",), "rows",
                   shapes=((heads * (m.qk_nope_head_dim + m.v_head_dim), r),)),
        TensorRule(L + "out.weight", (a + "o_proj.weight",), "cols", shapes=((h, heads * m.v_head_dim),)),
    ]


def layer_rules(cfg: ModelConfig, i: int, experts: Collection[int]) -> list[TensorRule]:
    p, L = layer_prefix(i), f"layers.{i}."
    m = p + "mlp."
    return _attention_rules(cfg, i) + [
        TensorRule(L + "input_norm.weight", (p + "input_layernorm.weight",), "replicated"),
        TensorRule(L + "post_attn_norm.weight", (p + "post_attention_layernorm.weight",), "replicated"),
        TensorRule(L + "mlp.fc1.weight", (m + "gate_proj.weight", m + "up_proj.weight"), "gate_up"),
        TensorRule(L + "mlp.fc2.weight", (m + "down_proj.weight",), "cols"),
    ]


DEEPSEEK_V3 = FamilySpec(("deepseek_v3",), "DeepseekV3ForCausalLM", normalise, layer_rules,
                         embedding="model.embed_tokens.weight", final_norm="model.norm")
