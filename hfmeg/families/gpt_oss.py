"""gpt-oss (`gpt_oss`, `GptOssForCausalLM`): LLaMA's attention with Q/K/V/O biases, an attention sink per query head
(`self_attn.sinks`, a logit in each query's softmax normaliser: `ModelConfig.attn_sinks`), windows on the layers
`layer_types` marks sliding (alternating by default), YaRN RoPE, and every MLP a mixture of experts.

Its MoE block differs from Mixtral's in four ways (`MoEConfig`): the router (`mlp.router`) has a bias; the top-k
weights are a softmax over the k chosen logits (Mixtral's renormalised top-k probabilities, `norm_topk_prob`); each
expert's projections have biases; and its GLU is clamped, (clamp(up, ±limit) + 1) · g · sigmoid(alpha · g) with
g = clamp(gate, max=limit) (`swiglu_alpha`, `swiglu_limit`). transformers holds and saves the experts stacked and
transposed, `mlp.experts.gate_up_proj` `[E, H, 2F]` whose columns alternate gate and up (`gate_up[..., ::2]`,
`[..., 1::2]`), `gate_up_proj_bias` `[E, 2F]` alike, `down_proj` `[E, F, H]`, `down_proj_bias` `[E, H]`: the rules
take expert e's slice, transpose it and de-interleave its rows into hfmeg's `[gate; up]` (split kind `interleaved`).

Its RMSNorms scale by w in fp32 and round once (`norm_fp32_scale`, as Gemma 4's). LoRA: peft (0.21) has no mapping
for gpt-oss's experts (not `nn.Linear`s; `target_parameters` on their transposed interleaved stacks is not built),
so `PeftNames` adapts attention only and expert or router targets are refused. The experts as openai publishes them,
in MXFP4 (`quantization_config`, `*_blocks` / `*_scales`), are dequantized as they are read
(`checkpoint/quantized.py`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Collection

from transformers import PretrainedConfig

from ..config import ModelConfig, MoEConfig, require
from .llama import ATTENTION, decoder_config, layer_prefix, layer_rules, layer_types_window
from .spec import FamilySpec, PeftNames, TensorRule


def gpt_oss_moe(hf: PretrainedConfig) -> MoEConfig:
    experts, top_k = hf.num_local_experts, hf.num_experts_per_tok
    require(experts >= 1, "num_local_experts", f"{experts}: a model without experts is not an MoE model")
    require(1 <= top_k <= experts, "num_experts_per_tok", f"{top_k} must be between 1 and num_local_experts={experts}")
    limit, alpha = float(hf.swiglu_limit), float(hf.swiglu_alpha)
    require(limit > 0, "swiglu_limit", f"{limit} is not a clamp (use a positive number)")
    return MoEConfig(num_experts=experts, top_k=top_k, expert_ffn_size=hf.intermediate_size, norm_topk_prob=True,
                     sparse_layers=list(range(hf.num_hidden_layers)), combine_fp32=False,
                     router_aux_loss_coef=float(hf.router_aux_loss_coef),
                     output_router_logits=bool(hf.output_router_logits), fused_experts=True,
                     experts_field="num_local_experts", router_bias=True, expert_bias=True, swiglu_alpha=alpha,
                     swiglu_limit=limit)


def normalise(hf: PretrainedConfig) -> ModelConfig:
    cfg = decoder_config(hf, window=layer_types_window, moe=gpt_oss_moe)
    return replace(cfg, attn_sinks=True, norm_fp32_scale=True)


def _moe_rules(cfg: ModelConfig, i: int, experts: Collection[int]) -> list[TensorRule]:
    m, h = cfg.moe, cfg.hidden_size
    E, f = m.num_experts, m.expert_ffn_size
    p, L = layer_prefix(i) + "mlp.", f"layers.{i}.mlp."
    x = p + "experts."
    rules = [TensorRule(L + "router.weight", (p + "router.weight",), "replicated", shapes=((E, h),)),
             TensorRule(L + "router.bias", (p + "router.bias",), "replicated", shapes=((E,),))]
    # One stacked HF tensor at a time, all its experts' slices together: each is read once (rules.rule_tensors).
    stacks = (("fc1.weight", "gate_up_proj", "interleaved", True, (E, h, 2 * f)),
              ("fc1.bias", "gate_up_proj_bias", "interleaved", False, (E, 2 * f)),
              ("fc2.weight", "down_proj", "replicated", True, (E, f, h)),
              ("fc2.bias", "down_proj_bias", "replicated", False, (E, h)))
    for local, hf, kind, transpose, shape in stacks:
        rules += [TensorRule(f"{L}experts.{e}.{local}", (x + hf,), kind, transpose=transpose, shapes=(shape,), expert=e)
                  for e in experts]
    return rules


def _layer_rules(cfg: ModelConfig, i: int, experts: Collection[int]) -> list[TensorRule]:
    sinks = TensorRule(f"layers.{i}.attn.sinks", (layer_prefix(i) + "self_attn.sinks",), "rows",
                       shapes=((cfg.num_heads,),))
    return layer_rules(cfg, i, experts, moe_rules=_moe_rules) + [sinks]


GPT_OSS = FamilySpec(("gpt_oss",), "GptOssForCausalLM", normalise, _layer_rules, embedding="model.embed_tokens.weight",
                     final_norm="model.norm", peft=PeftNames(ATTENTION))
