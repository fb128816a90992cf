"""Mixtral: Mistral with every MLP a mixture of experts (`block_sparse_moe.experts.{e}.w1/w3/w2` on disk).

peft (0.21) maps the v4 names onto transformers v5's stacked experts: `w1` + `w3` are one LoRA on
`gate_up_proj` (rank 2r), `w2` on `down_proj`, `gate` on the router; as in peft, `gate_proj ...`
adapt nothing here (`peft/config.py`)."""

from __future__ import annotations

from transformers import PretrainedConfig

from ..config import MoEConfig, require
from .llama import ATTENTION, decoder_config, every_layer_window, llama_layout
from .spec import ExpertNames, PeftNames


def mixtral_moe(hf: PretrainedConfig) -> MoEConfig:
    experts, top_k = hf.num_local_experts, hf.num_experts_per_tok
    require(experts >= 1, "num_local_experts", f"{experts}: a model without experts is not an MoE model")
    require(1 <= top_k <= experts, "num_experts_per_tok", f"{top_k} must be between 1 and num_local_experts={experts}")
    jitter = getattr(hf, "router_jitter_noise", 0.0) or 0.0
    require(jitter == 0, "router_jitter_noise", f"{jitter}: router jitter (random input noise) is not supported")
    return MoEConfig(num_experts=experts, top_k=top_k, expert_ffn_size=hf.intermediate_size,
                     norm_topk_prob=True, sparse_layers=list(range(hf.num_hidden_layers)), combine_fp32=True,
                     router_aux_loss_coef=float(hf.router_aux_loss_coef),
                     output_router_logits=bool(hf.output_router_logits), experts_field="num_local_experts")


MIXTRAL = llama_layout(
    ("mixtral",), "MixtralForCausalLM", lambda hf: decoder_config(hf, window=every_layer_window, moe=mixtral_moe),
    experts=ExpertNames("block_sparse_moe.", "w1", "w3", "w2"),
    peft=PeftNames(ATTENTION, {"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj", "gate": "gate.weight"},
                   fused=("w1", "w3")))
