"""Qwen3-Next (`qwen3_next`, `Qwen3NextForCausalLM`): Qwen3.5-MoE's layers (`qwen3_5.py`: Gated DeltaNet layers
between gated full-attention ones, (1 + w) RMSNorms, partial RoPE) with two differences. Its linear attention projects
with two fused tensors laid out per key head: `in_proj_qkvz` holds, for each key head, its q and k rows and the v
and z rows of the value heads it serves, `in_proj_ba` likewise its value heads' b and a rows; one `parts` rule with
`groups` (`checkpoint/rules.py`) reorders them into hfmeg's `[q; k; v; z; b; a]` projection and back. Its MLP is
Qwen2-MoE's (`qwen2_moe.qwen_moe`: sparse every `decoder_sparse_step` layers but `mlp_only_layers`, a shared expert
gated by sigmoid(shared_expert_gate(x))). RoPE is plain (not multimodal). The published multi-token-prediction module
(`mtp.…`, which transformers does not build) is carried verbatim. LoRA is not built for it (as for Qwen3.5-MoE)."""

from __future__ import annotations

from dataclasses import replace

from transformers import PretrainedConfig

from ..config import ModelConfig
from .llama import MLP, layer_prefix, llama_layout
from .qwen2_moe import qwen_moe
from .qwen3_5 import mtp_module, normalise as qwen3_5_normalise, rules as qwen3_5_rules
from .spec import TensorRule


def normalise(hf: PretrainedConfig) -> ModelConfig:
    return qwen3_5_normalise(hf, lambda hf: qwen_moe(hf, hf.shared_expert_intermediate_size))


def rules(cfg: ModelConfig, i: int, experts) -> list[TensorRule]:
    """Qwen3.5's rules, the linear attention's input projection read from the two per-key-head fused tensors."""
    out = qwen3_5_rules(cfg, i, experts)
    if not cfg.is_linear(i):
        return out
    la, a = cfg.linear_attention, f"{layer_prefix(i)}linear_attn."
    q, k, v, z, b, g = la.in_pieces()
    fused = TensorRule(f"layers.{i}.attn.in_proj.weight", (a + "in_proj_qkvz.weight", a + "in_proj_ba.weight"),
                       "parts", shapes=((q + k + v + z, cfg.hidden_size), (b + g, cfg.hidden_size)),
                       pieces=la.in_pieces(), groups=la.key_heads)
    return [fused if r.local == fused.local else r for r in out]


QWEN3_NEXT = replace(llama_layout(("qwen3_next",), "Qwen3NextForCausalLM", normalise, experts=MLP, peft=None),
                     layer_rules=rules, carried=mtp_module)
