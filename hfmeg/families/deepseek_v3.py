"""DeepSeek-V3 (`deepseek_v3`, `DeepseekV3ForCausalLM`): multi-head latent attention (`ModelConfig.mla`,
`models/latent_attention.py`) in every layer, a dense SwiGLU MLP in the first `first_k_dense_replace` layers and an
MoE block in the others: sigmoid routing over expert groups with a correction bias (`models/routing.py`), the
weights times `routed_scaling_factor`, and `n_shared_experts` shared experts as one ungated SwiGLU MLP. transformers'
DeepSeek-V3 adds no load-balancing loss (`output_router_logits` only records the logits), so neither does hfmeg.

MLA's tensors: `self_attn.q_a_proj` and `kv_a_proj_with_mqa` and their norms are whole on every TP rank, `q_b_proj`
(or `q_proj` without a query latent) and `kv_b_proj` split by rows (whole heads), `o_proj` by columns. The MoE
block's: the router `mlp.gate.weight`, its `mlp.gate.e_score_correction_bias`, the experts as Qwen's
(`mlp.experts.{e}.{gate,up,down}_proj`, or stacked) and `mlp.shared_experts.{gate,up,down}_proj`.

Multi-token prediction: transformers (5.24) builds no MTP module and skips a checkpoint's MTP layers
(`model.layers.{num_hidden_layers}.*`) on load; hfmeg computes what transformers computes, so it does not train them:
they are carried verbatim (`FamilySpec.carried`) into the export, untrained (docs/moe.md).

LoRA: peft (0.21) maps DeepSeek-V3 as Qwen2-MoE for its experts (transformers' conversion table): `gate_proj` +
`up_proj` adapt the stacked experts' `gate_up_proj`, `down_proj` theirs, `gate` the router, and the dense layers'
MLPs and the shared experts are not adapted; the attention's five projections are plain LoRA (`peft/adapters.py`).

Not built, refused by its field: biases on the attention projections (`attention_bias`).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Collection

from transformers import PretrainedConfig

from ..config import MLAConfig, ModelConfig, MoEConfig, require
from .llama import _moe_rules, decoder_config, layer_prefix
from .qwen3_moe import QWEN3_MOE
from .spec import ExpertNames, FamilySpec, PeftNames, TensorRule

EXPERTS = ExpertNames("mlp.", "gate_proj", "up_proj", "down_proj", shared="shared_experts.")
# peft's names of MLA's projections: the query's (one projection, or the latent's two), the a-projections (whole on
# every TP rank) and all of them in the decoder's order
QUERY, QUERY_LATENT = "q_proj", ("q_a_proj", "q_b_proj")
LATENT_A = ("q_a_proj", "kv_a_proj_with_mqa")
PROJECTIONS = (QUERY, *QUERY_LATENT, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def _mla(hf: PretrainedConfig) -> MLAConfig:
    # Imported here: the modeling module pulls in transformers' modeling utilities (accelerate, FSDP,
    # torch._dynamo, ~0.6 s and more under load) into every process that imports hfmeg.families.
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    qk = hf.qk_nope_head_dim + hf.qk_rope_head_dim
    require(hf.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", f"{hf.qk_rope_head_dim}: RoPE rotates pairs (use an even size)")
    return MLAConfig(q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=hf.qk_nope_head_dim,
                     qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
                     rope_interleave=bool(hf.rope_interleave),
                     softmax_scale=yarn_apply_mscale(hf.rope_parameters, qk ** -0.5))


def _moe(hf: PretrainedConfig) -> MoEConfig:
    # null counts (the config's types allow them; transformers' router cannot run with them) are refused as 0
    experts, top_k = hf.n_routed_experts or 0, hf.num_experts_per_tok or 0
    groups, best = hf.n_group or 0, hf.topk_group or 0
    require(experts >= 1, "n_routed_experts", f"{experts}: a model without experts is not an MoE model")
    require(groups >= 1 and experts % groups == 0, "n_group", f"{groups} must divide n_routed_experts={experts}")
    require(experts // groups >= 2, "n_group", f"{groups}: a group is ranked by its two best scores, so each needs "
            f"2 experts or more (n_routed_experts={experts})")
    require(1 <= best <= groups, "topk_group", f"{best} must be between 1 and n_group={groups}")
    require(1 <= top_k <= best * experts // groups, "num_experts_per_tok",
            f"{top_k} must be between 1 and the {best * experts // groups} experts of topk_group={best} groups")
    require(hf.n_shared_experts >= 0, "n_shared_experts", f"{hf.n_shared_experts} is not a count")
    dense = hf.first_k_dense_replace or 0
    return MoEConfig(num_experts=experts, top_k=top_k, expert_ffn_size=hf.moe_intermediate_size,
                     norm_topk_prob=bool(hf.norm_topk_prob), sparse_layers=list(range(dense, hf.num_hidden_layers)),
                     combine_fp32=True, shared_expert_ffn_size=hf.moe_intermediate_size * hf.n_shared_experts,
                     experts_field="n_routed_experts", scoring="sigmoid", n_group=groups, topk_group=best,
                     routed_scaling_factor=float(hf.routed_scaling_factor), score_correction_bias=True,
                     shared_expert_gate=False)


def normalise(hf: PretrainedConfig) -> ModelConfig:
    require(not hf.attention_bias, "attention_bias", f"{hf.attention_bias!r}: biases on {hf.model_type}'s attention "
            "projections are not supported (use false)")
    heads = hf.num_attention_heads
    require(hf.num_key_value_heads == heads, "num_key_value_heads", f"{hf.num_key_value_heads}: MLA expands its keys "
            f"and values to every head (use num_attention_heads={heads})")
    mla = _mla(hf)
    cfg = decoder_config(hf, moe=_moe)
    if not cfg.moe.sparse_layers:
        cfg = replace(cfg, moe=None)  # every layer dense
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
    rules = _attention_rules(cfg, i) + [
        TensorRule(L + "input_norm.weight", (p + "input_layernorm.weight",), "replicated"),
        TensorRule(L + "post_attn_norm.weight", (p + "post_attention_layernorm.weight",), "replicated"),
    ]
    if cfg.is_sparse(i):
        return rules + _moe_rules(cfg, i, experts, EXPERTS)  # the LLaMA layout's MoE tensors, DeepSeek's names
    return rules + [TensorRule(L + "mlp.fc1.weight", (m + "gate_proj.weight", m + "up_proj.weight"), "gate_up"),
                    TensorRule(L + "mlp.fc2.weight", (m + "down_proj.weight",), "cols")]


def mtp_layer(name: str, config: dict) -> bool:
    """Whether HF tensor `name` is one of the MTP layers', numbered after the model's `num_hidden_layers`."""
    found = re.match(r"model\.layers\.(\d+)\.", name)
    return found is not None and int(found.group(1)) >= config.get("num_hidden_layers", math.inf)


DEEPSEEK_V3 = FamilySpec(("deepseek_v3",), "DeepseekV3ForCausalLM", normalise, layer_rules,
                         embedding="model.embed_tokens.weight", final_norm="model.norm", experts=EXPERTS,
                         peft=PeftNames(PROJECTIONS, QWEN3_MOE.peft.experts, fused=QWEN3_MOE.peft.fused),
                         carried=mtp_layer)
