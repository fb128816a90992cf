"""Qwen3-MoE: Qwen2-MoE's experts without the shared one, RMSNorm over each query and key head (QK-norm),
`attention_bias` for both projections.

peft (0.21) maps `gate_proj` + `up_proj` onto the stacked experts' `gate_up_proj` (one LoRA, rank 2r),
`down_proj` onto theirs, `gate` onto the router; a dense layer's MLP is not adapted, as in peft."""

from __future__ import annotations

from .llama import ATTENTION, MLP, decoder_config, llama_layout, no_window
from .qwen2_moe import qwen_moe
from .spec import PeftNames

QWEN3_MOE = llama_layout(
    ("qwen3_moe",), "Qwen3MoeForCausalLM", lambda hf: decoder_config(hf, window=no_window, qk_norm=True, moe=qwen_moe), experts=MLP,
    peft=PeftNames(ATTENTION, {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj",
                               "gate": "gate.weight"}, fused=("gate_proj", "up_proj")))
