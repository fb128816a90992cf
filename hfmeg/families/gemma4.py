"""Gemma 4 text (`gemma4_text`, `Gemma4ForCausalLM`): Gemma 3's layout and switches (windows per `layer_types`, RoPE
per layer type, four norms a layer, GeGLU, scaled embedding, final-logit soft-capping, per-head QK-norm) with three
changes: its RMSNorms scale by w, not 1 + w, in fp32 (`ModelConfig.norm_fp32_scale`); the values are RMS-normalised
per head with no weight (`v_norm`); and the attention scale is 1 (the q/k norms set the scores' size; transformers'
Gemma 4 has no `query_pre_attn_scalar`). Each layer's `layer_scalar` tensor multiplies its output: hfmeg keeps it
verbatim and refuses a checkpoint where it is not 1 (`FamilySpec.fixed`).

What Gemma 4 adds beyond that is refused, by the config field that switches it on: per-layer input embeddings
(`hidden_size_per_layer_input`), KV sharing across layers (`num_kv_shared_layers`), keys reused as values
(`attention_k_eq_v`), the MoE block (`enable_moe_block`), and per-layer attention shapes (`per_layer_config`:
`global_head_dim` or `num_global_key_value_heads` unlike the sliding layers'). `use_double_wide_mlp` widens only
the KV-sharing layers' MLPs, so it changes nothing once sharing is refused; the full layers' `proportional` RoPE
(partial rotary) is refused by the per-layer-type RoPE check."""

from __future__ import annotations

import re
from dataclasses import replace

from transformers import PretrainedConfig

from ..config import ModelConfig, require
from .gemma2 import ACT_FIELD, gemma_switches
from .llama import decoder_config, layer_types_window, llama_layout, rope_per_layer_type

# The fields that switch on what hfmeg does not build, and the value that leaves it off.
UNBUILT = {"hidden_size_per_layer_input": "per-layer input embeddings", "num_kv_shared_layers": "KV sharing across layers",
           "attention_k_eq_v": "keys reused as values", "enable_moe_block": "the MoE block"}


def normalise(hf: PretrainedConfig) -> ModelConfig:
    for name, what in UNBUILT.items():
        value = getattr(hf, name, None)
        require(not value, name, f"{value!r}: {what} are not supported for {hf.model_type} (use 0, false or null)")
    # transformers' per-layer overrides (its heterogeneous configs); overrides equal to the global values are dropped.
    spec = getattr(hf, "_heterogeneity_spec", None)
    layers = spec.per_layer_overrides if spec is not None else {}
    attrs = sorted(spec.per_layer_attributes) if layers else []
    require(not layers, "per_layer_config", f"layers {sorted(layers)} override {attrs}: per-layer attention shapes "
            f"are not supported for {hf.model_type}")
    rope_per_layer_type(hf)
    cfg = gemma_switches(hf, decoder_config(hf, window=layer_types_window, qk_norm=True, act_field=ACT_FIELD))
    return replace(cfg, rope_per_layer_type=True, attn_softcap=None, norm_offset=False, norm_fp32_scale=True,
                   v_norm=True, query_pre_attn_scalar=1.0)


def fixed(name: str) -> float | None:
    return 1.0 if re.fullmatch(r"model\.layers\.\d+\.layer_scalar", name) else None


GEMMA4 = replace(llama_layout(("gemma4_text",), "Gemma4ForCausalLM", normalise), fixed=fixed)
