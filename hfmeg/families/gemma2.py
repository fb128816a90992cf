"""Gemma 2 (`gemma2`): LLaMA's weight layout with four norms a layer, all of them (1 + w) RMSNorms: `input_layernorm`
before attention, `post_attention_layernorm` on the attention's output, `pre_feedforward_layernorm` before the
MLP, `post_feedforward_layernorm` on its output (`ModelConfig.sandwich_norms`, `norm_offset`). The embedding is
scaled by sqrt(hidden), the MLP is GeGLU (`gelu_pytorch_tanh`), the attention scale is
`query_pre_attn_scalar`^-0.5, attention scores and final logits are soft-capped (`attn_logit_softcapping`,
`final_logit_softcapping`), and `layer_types` alternates sliding-window and full layers. Embeddings are tied."""

from __future__ import annotations

from dataclasses import replace
from transformers import PretrainedConfig

from ..config import ModelConfig, require
from .llama import decoder_config, layer_types_window, llama_layout

ACT_FIELD = "hidden_activation"  # what transformers' Gemma MLP reads; published configs also carry hidden_act


def gemma_switches(hf: PretrainedConfig, cfg: ModelConfig, causal_on_text: tuple[str, ...] = ()) -> ModelConfig:
    """The Gemma switches on a LLaMA-layout config (read with `act_field=ACT_FIELD`), from the fields Gemma 2 and 3
    share. `causal_on_text`: values of `use_bidirectional_attention` that leave text tokens causal (Gemma 4's
    'vision': only image tokens see ahead)."""
    bidirectional = getattr(hf, "use_bidirectional_attention", None)
    require(not bidirectional or bidirectional in causal_on_text, "use_bidirectional_attention",
            f"{bidirectional!r}: bidirectional attention is not supported (causal language models only)")
    caps = {}
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = getattr(hf, name, None)
        require(cap is None or cap > 0, name, f"{cap} is not a cap (use a positive number or null)")
        caps[name] = cap
    return replace(cfg, norm_offset=True, embed_scale=True, sandwich_norms=True,
                   attn_softcap=caps["attn_logit_softcapping"], final_softcap=caps["final_logit_softcapping"],
                   query_pre_attn_scalar=getattr(hf, "query_pre_attn_scalar", None))


def normalise(hf: PretrainedConfig) -> ModelConfig:
    return gemma_switches(hf, decoder_config(hf, window=layer_types_window, act_field=ACT_FIELD))


GEMMA2 = llama_layout(("gemma2",), "Gemma2ForCausalLM", normalise)
