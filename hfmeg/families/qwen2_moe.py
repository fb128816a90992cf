"""Qwen2-MoE: Qwen2 with sparse MLPs every `decoder_sparse_step` layers (not `mlp_only_layers`) and an
always-on shared expert gated by `sigmoid(shared_expert_gate(x))`.

peft (0.21) maps no names onto its stacked experts (its model type is not in transformers' conversion
table), so its names adapt `nn.Linear`s only: attention, the shared expert's projections (and a dense
layer's MLP) and the shared expert's gate; its routed experts and router are not reachable by name."""

from __future__ import annotations

from transformers import PretrainedConfig

from ..config import MoEConfig, require
from .llama import MLP, PROJECTIONS, decoder_config, llama_layout, no_window
from .spec import PeftNames

SHARED_GATE = "shared_expert_gate"


def qwen_moe(hf: PretrainedConfig, shared: int = 0) -> MoEConfig:
    """The MoE fields of a Qwen2-MoE / Qwen3-MoE config, as their HF modeling code reads them."""
    experts, top_k = hf.num_experts, hf.num_experts_per_tok
    require(experts >= 1, "num_experts", f"{experts}: a model without experts is not an MoE model")
    require(1 <= top_k <= experts, "num_experts_per_tok", f"{top_k} must be between 1 and num_experts={experts}")
    step = hf.decoder_sparse_step
    require(step >= 1, "decoder_sparse_step", f"{step} must be at least 1")
    dense = set(getattr(hf, "mlp_only_layers", None) or [])
    sparse = [i for i in range(hf.num_hidden_layers) if i not in dense and (i + 1) % step == 0]
    return MoEConfig(num_experts=experts, top_k=top_k, expert_ffn_size=hf.moe_intermediate_size,
                     norm_topk_prob=bool(hf.norm_topk_prob), sparse_layers=sparse, combine_fp32=False,
                     shared_expert_ffn_size=shared, router_aux_loss_coef=float(hf.router_aux_loss_coef),
                     output_router_logits=bool(hf.output_router_logits))


def _normalise(hf: PretrainedConfig):
    return decoder_config(hf, qkv_bias=bool(getattr(hf, "qkv_bias", True)), out_bias=False, window=no_window,
                          moe=lambda hf: qwen_moe(hf, getattr(hf, "shared_expert_intermediate_size", 0)))


QWEN2_MOE = llama_layout(("qwen2_moe",), "Qwen2MoeForCausalLM", _normalise, experts=MLP,
                         peft=PeftNames(PROJECTIONS + (SHARED_GATE,)))
