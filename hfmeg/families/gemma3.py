"""Gemma 3 text (`gemma3_text`, `Gemma3ForCausalLM`): Gemma 2's layout and switches (`gemma2.gemma_switches`) with
QK-norm ((1 + w) RMSNorm over each query and key head, `self_attn.q_norm`/`k_norm`) and RoPE per layer type: the
sliding layers rotate with `rope_parameters["sliding_attention"]` (`rope_local_base_freq`), the full layers with
`rope_parameters["full_attention"]` (`rope_theta` and `rope_scaling`), as transformers normalises them
(`ModelConfig.rope_per_layer_type`). transformers' Gemma 3 attention does not apply `attn_logit_softcapping`
(its field is read and unused, transformers 5.x), so neither does hfmeg: the final logits are soft-capped."""

from __future__ import annotations

from dataclasses import replace

from transformers import PretrainedConfig

from ..config import SUPPORTED_ROPE_TYPES, ModelConfig, require
from .gemma2 import gemma_layout, gemma_switches
from .llama import decoder_config, layer_types_window

LAYER_TYPES = ("sliding_attention", "full_attention")


def normalise(hf: PretrainedConfig) -> ModelConfig:
    params = getattr(hf, "rope_parameters", None) or {}
    require(set(params) == set(LAYER_TYPES), "rope_parameters", f"one entry per layer type ({', '.join(LAYER_TYPES)}) "
            f"expected, got {sorted(params)}")
    built = tuple(t for t in SUPPORTED_ROPE_TYPES if t != "longrope")  # LongRoPE per layer type: not built
    for layer_type in LAYER_TYPES:
        p = params[layer_type]
        rope_type = p.get("rope_type", "default")
        require(rope_type in built, f"rope_parameters.{layer_type}.rope_type",
                f"{rope_type!r} is not supported for {hf.model_type} (supported: {', '.join(built)})")
        require(p.get("partial_rotary_factor", 1.0) == 1.0, f"rope_parameters.{layer_type}.partial_rotary_factor",
                f"partial rotary embeddings are not supported for {hf.model_type}")
    require(getattr(hf, "sliding_window", None) is not None, "sliding_window",
            "null: Gemma 3's sliding layers need a window")
    cfg = gemma_switches(hf, decoder_config(hf, window=layer_types_window, qk_norm=True))
    return replace(cfg, rope_per_layer_type=True, attn_softcap=None)


GEMMA3 = gemma_layout(("gemma3_text",), "Gemma3ForCausalLM", normalise)
