"""Qwen3.5 text (`qwen3_5_text`, `Qwen3_5ForCausalLM`) and its MoE variant (`qwen3_5_moe_text`,
`Qwen3_5MoeForCausalLM`: the same layers with Qwen2-MoE's block, routed experts and a gated shared expert, as the
MLP of every layer): Gated DeltaNet linear-attention layers interleaved with
gated full attention (`layer_types`: linear_attention / full_attention; three linear layers to one full by
default).

A full-attention layer is Qwen3's (QK-norm per head, `head_dim` of its own, GQA) with three changes: its
`q_proj` makes, per head, the query and a gate of the same size (`[q_h; gate_h]` rows), and the attention output
is multiplied by sigmoid(gate) before `o_proj` (`ModelConfig.attn_output_gate`); RoPE turns the first
`partial_rotary_factor` of each head only (0.25); every RMSNorm (the layers', the final one and the q/k norms)
scales by (1 + w) in fp32 (`norm_offset`, as Gemma's). RoPE is transformers' multimodal one (`mrope_section`):
on text, where the temporal, height and width positions are the same, it is plain RoPE on those dims.

A linear-attention layer (`models/gated_deltanet.py`, `ModelConfig.linear_attention`) replaces `self_attn` by
`linear_attn`: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` (one column-parallel projection in hfmeg,
split by heads: rule kind `parts`), the depthwise `conv1d` over q, k, v, `A_log` and `dt_bias` per value head,
the gated RMSNorm `norm` (w, not 1 + w) and `out_proj`. Context parallelism is refused for it
(`config.check_cp`). LoRA (and DoRA) take peft's names for every projection (`all-linear`: the attention's, the
linear attention's `in_proj_*` and `out_proj`, the MLP's); the convolution, a `Conv1d`, is not adapted.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from transformers import PretrainedConfig

from ..config import LinearAttentionConfig, ModelConfig, MoEConfig, require
from .llama import ATTENTION, MLP, PROJECTIONS, decoder_config, layer_prefix, layer_rules, llama_layout, rope_buffer
from .spec import PeftNames, TensorRule

LAYER_TYPES = ("linear_attention", "full_attention")


def linear_attention(hf: PretrainedConfig) -> LinearAttentionConfig:
    types = list(hf.layer_types)
    require(set(types) <= set(LAYER_TYPES), "layer_types",
            f"{sorted(set(types) - set(LAYER_TYPES))} are not supported (supported: {', '.join(LAYER_TYPES)})")
    require(len(types) == hf.num_hidden_layers, "layer_types",
            f"{len(types)} entries for num_hidden_layers={hf.num_hidden_layers}")
    la = LinearAttentionConfig(tuple(i for i, t in enumerate(types) if t == "linear_attention"),
                               hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim,
                               hf.linear_value_head_dim, hf.linear_conv_kernel_dim)
    require(la.value_heads % la.key_heads == 0, "linear_num_value_heads",
            f"{la.value_heads} is not a multiple of linear_num_key_heads={la.key_heads}")
    return la


def normalise(hf: PretrainedConfig, moe: Callable[[PretrainedConfig], MoEConfig] | None = None) -> ModelConfig:
    cfg = decoder_config(hf, qk_norm=True, partial_rotary=True, moe=moe)
    return replace(cfg, norm_offset=True, attn_output_gate=True, linear_attention=linear_attention(hf))


def sparse_mlp(hf: PretrainedConfig) -> MoEConfig:
    """Qwen3.5-MoE's MLP, on every layer: top-k of a softmax router, always renormalised, and a shared expert gated
    by sigmoid(shared_expert_gate(x)) (Qwen2-MoE's block)."""
    experts, top_k = hf.num_experts, hf.num_experts_per_tok
    require(experts >= 1, "num_experts", f"{experts}: a model without experts is not an MoE model")
    require(1 <= top_k <= experts, "num_experts_per_tok", f"{top_k} must be between 1 and num_experts={experts}")
    return MoEConfig(num_experts=experts, top_k=top_k, expert_ffn_size=hf.moe_intermediate_size, norm_topk_prob=True,
                     sparse_layers=list(range(hf.num_hidden_layers)), combine_fp32=False,
                     shared_expert_ffn_size=hf.shared_expert_intermediate_size,
                     router_aux_loss_coef=float(hf.router_aux_loss_coef),
                     output_router_logits=bool(hf.output_router_logits))


def rules(cfg: ModelConfig, i: int, experts) -> list[TensorRule]:
    """Layer i's rules: LLaMA's layout (with the gate rows in q_proj), or for a linear-attention layer its norms
    and MLP with `linear_attn`'s tensors in place of `self_attn`'s."""
    base = layer_rules(cfg, i, experts)
    if not cfg.is_linear(i):
        return base
    la, h = cfg.linear_attention, cfg.hidden_size
    L, a = f"layers.{i}.attn.", f"{layer_prefix(i)}linear_attn."
    key, value = la.key_heads * la.key_dim, la.value_heads * la.value_dim
    q, k, v, z, b, g = la.in_pieces()
    return [r for r in base if not r.local.startswith(L)] + [
        TensorRule(L + "in_proj.weight", tuple(a + n for n in ("in_proj_qkv.weight", "in_proj_z.weight",
                                                               "in_proj_b.weight", "in_proj_a.weight")),
                   "parts", shapes=((q + k + v, h), (z, h), (b, h), (g, h)), pieces=la.in_pieces()),
        TensorRule(L + "conv_weight", (a + "conv1d.weight",), "parts", shapes=((la.conv_channels, 1, la.conv_kernel),),
                   pieces=(key, key, value)),
        TensorRule(L + "A_log", (a + "A_log",), "rows", shapes=((la.value_heads,),)),
        TensorRule(L + "dt_bias", (a + "dt_bias",), "rows", shapes=((la.value_heads,),)),
        TensorRule(L + "norm_weight", (a + "norm.weight",), "replicated", shapes=((la.value_dim,),)),
        TensorRule(L + "out.weight", (a + "out_proj.weight",), "cols", shapes=((h, value),)),
    ]


# peft's `all-linear` on Qwen3.5: the attention projections, the linear-attention projections and the MLP's.
LINEAR_ATTENTION = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
PEFT = PeftNames(ATTENTION + LINEAR_ATTENTION + PROJECTIONS[4:])



def mtp_module(name: str, config: dict) -> bool:
    """The multi-token-prediction module published checkpoints hold (`mtp.…`): transformers does not build it (it
    ignores `^mtp.*` on loading), so it is carried verbatim, as are LLaMA-layout RoPE buffers (`llama.rope_buffer`)."""
    return name.startswith("mtp.") or rope_buffer(name, config)


QWEN3_5 = replace(llama_layout(("qwen3_5_text",), "Qwen3_5ForCausalLM", normalise, peft=PEFT), layer_rules=rules,
                  carried=mtp_module)
# LoRA on the MoE variant is not built (peft reaches its stacked experts only through target_parameters).
QWEN3_5_MOE = replace(llama_layout(("qwen3_5_moe_text",), "Qwen3_5MoeForCausalLM",
                                   lambda hf: normalise(hf, sparse_mlp), experts=MLP, peft=None), layer_rules=rules,
                      carried=mtp_module)
