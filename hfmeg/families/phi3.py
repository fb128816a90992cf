"""Phi-3 and Phi-4 (`phi3`): LLaMA with Q, K and V in one HF tensor `self_attn.qkv_proj` (rows `[q heads; k heads;
v heads]`, GQA-sized) and gate and up in one `mlp.gate_up_proj` (rows `[gate; up]`). The tensor rules cut them by
their sizes into hfmeg's per-KV-group QKV and `[gate_r; up_r]` slices and join them back (`checkpoint/rules.py`,
kinds `qkv` and `gate_up` from one HF tensor). RoPE may be partial (`partial_rotary_factor`: Phi-4-mini rotates
the first 3/4 of each head) and LongRoPE-scaled (the 128k variants); the sliding window (Phi-3-mini-4k: 2047 on
every layer) is Mistral's, a real window.

LoRA under peft's names `qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`: on a fused one, as in peft, one A and one
B over all its rows (`PeftNames.fused_bases`; B's rows are laid out like the fused weight's, `peft/adapters.py`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Collection

from ..config import ModelConfig
from .llama import decoder_config, every_layer_window, layer_prefix, layer_rules, llama_layout
from .spec import PeftNames, TensorRule


def fused_rules(cfg: ModelConfig, i: int, experts: Collection[int]) -> list[TensorRule]:
    """LLaMA's rules with the QKV and gate/up weights each read from Phi-3's one fused HF tensor."""
    p = layer_prefix(i)
    fused = {f"layers.{i}.attn.qkv.weight": p + "self_attn.qkv_proj.weight",
             f"layers.{i}.mlp.fc1.weight": p + "mlp.gate_up_proj.weight"}
    return [replace(r, hf=(fused[r.local],)) if r.local in fused else r for r in layer_rules(cfg, i, experts)]


PHI3 = replace(llama_layout(("phi3",), "Phi3ForCausalLM",
                            lambda hf: decoder_config(hf, window=every_layer_window, partial_rotary=True),
                            peft=PeftNames(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
                                           fused_bases={"attn.qkv": "qkv_proj", "mlp.fc1": "gate_up_proj"})),
               layer_rules=fused_rules)
