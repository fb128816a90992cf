"""Gemma 4 text (`gemma4_text`, `Gemma4ForCausalLM`): Gemma 3's layout and switches (windows per `layer_types`, RoPE
per layer type, four norms a layer, GeGLU, scaled embedding, final-logit soft-capping, per-head QK-norm) with three
changes: its RMSNorms scale by w, not 1 + w, in fp32 (`ModelConfig.norm_fp32_scale`); the values are RMS-normalised
per head with no weight (`v_norm`); and the attention scale is 1 (the q/k norms set the scores' size; transformers'
Gemma 4 has no `query_pre_attn_scalar`). Each layer's `layer_scalar` tensor (a buffer in transformers, saved with the
weights) multiplies its output: hfmeg loads it as a frozen parameter and exports it unchanged
(`ModelConfig.layer_scalar`).

As the 31B and the 26B-A4B are published (`tests/releases/`):
- their full-attention layers have a shape of their own (`ModelConfig.global_attention`): wider heads
  (`global_head_dim`, 512 against 256) and, with `attention_k_eq_v`, fewer KV heads (`num_global_key_value_heads`)
  whose values are their keys (no `v_proj`: the raw key projection, value-normed). transformers keeps the shape as
  per-layer overrides (`per_layer_config`); hfmeg builds overrides of `head_dim` and `num_key_value_heads` that are
  the same on every full layer, and refuses others naming the field;
- the full layers' `proportional` RoPE (the first `partial_rotary_factor` of each head's frequencies, the rest zero)
  is transformers' own table over the wider head;
- `use_bidirectional_attention: vision` lets image tokens see ahead; text, all hfmeg trains on, stays causal ('all'
  is refused);
- the 26B-A4B's MoE block (`enable_moe_block`) runs in every layer beside the dense MLP (`MoEConfig.beside_dense`,
  `router_scales`; `models/moe.py`): transformers names it beside `mlp` (`router.*`, stacked `experts.*`,
  `pre_feedforward_layernorm_2`, `post_feedforward_layernorm_1`/`_2`), and its experts spread over EP ranks. LoRA
  adapts the attention and the dense MLP (peft's names); the router and the experts are not adapted (peft's
  `all-linear` would take the router's `proj` too: name the projections).

As the E2B and E4B are published (`tests/releases/`):
- per-layer input embeddings (`hidden_size_per_layer_input`, `models/per_layer_inputs.py`): transformers'
  `embed_tokens_per_layer` (`[vocab, layers * P]`, split by vocabulary rows as the token embedding is, so
  `vocab_size_per_layer_input` must be `vocab_size`, as published), `per_layer_model_projection` and
  `per_layer_projection_norm` on the first stage, and in each layer `per_layer_input_gate`, `per_layer_projection`
  and `post_per_layer_input_norm`;
- KV sharing (`num_kv_shared_layers`): the last n layers have no `k_proj`, `v_proj` or `k_norm` and attend with the
  keys and values of the last earlier layer of their type (`ModelConfig.kv_source`, transformers'
  `kv_sharing_modes`), sent between pipeline stages with the activations where a split parts them
  (`models/shared_kv.py`);
- `use_double_wide_mlp`: those layers' MLPs are twice `intermediate_size` wide (`ModelConfig.wide_mlp_layers`).
LoRA adapts peft's projection names there too (a reusing layer has only q_proj and o_proj); the per-layer input
projections, which peft's `all-linear` would take, are not adapted: name the projections."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import replace
from typing import Collection

from transformers import PretrainedConfig

from ..config import AttentionShape, ModelConfig, MoEConfig, require
from .gemma2 import ACT_FIELD, gemma_switches
from .llama import PROJECTIONS, decoder_config, layer_prefix, layer_rules, layer_types_window, rope_per_layer_type
from .spec import FamilySpec, PeftNames, TensorRule

SHAPED = {"head_dim", "num_key_value_heads"}
HETEROGENEITY_LOGGER = "transformers.integrations.heterogeneity.configuration_utils"  # the per-layer overrides hfmeg builds (on the full layers)


def global_attention(hf: PretrainedConfig, full_layers: tuple[int, ...]) -> AttentionShape | None:
    """The full-attention layers' shape from transformers' per-layer overrides (its heterogeneous config), None
    where they have the model's; overrides equal to the model's values are dropped by transformers already."""
    spec = getattr(hf, "_heterogeneity_spec", None)
    layers = spec.per_layer_overrides if spec is not None else {}
    k_eq_v = bool(getattr(hf, "attention_k_eq_v", False))
    if not layers and not k_eq_v:
        return None
    attrs = sorted({a for o in layers.values() for a in o})
    require(set(attrs) <= SHAPED, "per_layer_config", f"layers {sorted(layers)} override {attrs}: only "
            f"{sorted(SHAPED)} are supported per layer for {hf.model_type}")
    require(set(layers) <= set(full_layers), "per_layer_config", f"layers {sorted(set(layers) - set(full_layers))} "
            f"override the attention shape but are not full_attention layers: not supported for {hf.model_type}")
    shapes = {i: (layers.get(i, {}).get("num_key_value_heads", hf.num_key_value_heads),
                  layers.get(i, {}).get("head_dim", hf.head_dim)) for i in full_layers}
    require(len(set(shapes.values())) <= 1, "per_layer_config", f"the full_attention layers' shapes differ "
            f"({sorted(set(shapes.values()))}): not supported for {hf.model_type}")
    kv, d = next(iter(shapes.values()), (hf.num_key_value_heads, hf.head_dim))
    require(hf.num_attention_heads % kv == 0, "num_global_key_value_heads",
            f"{kv} does not divide num_attention_heads={hf.num_attention_heads}")
    return AttentionShape(kv, d, values_from_keys=k_eq_v)


@contextmanager
def global_values(hf: PretrainedConfig):
    """transformers refuses to read a per-layer attribute (`head_dim`, `num_key_value_heads`) off a heterogeneous
    config as a whole, and warns where allowed to; its global value is the model's (the sliding layers'), which
    `decoder_config` reads, and `global_attention` reads the full layers' own: hfmeg handles both, so it reads
    them allowed and unwarned."""
    before = getattr(hf, "allow_global_per_layer_attribute_access", None)
    if before is None:
        yield
        return
    warner = logging.getLogger(HETEROGENEITY_LOGGER)
    level = warner.level
    hf.allow_global_per_layer_attribute_access = True
    warner.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hf.allow_global_per_layer_attribute_access = before
        warner.setLevel(level)


def moe_block(hf: PretrainedConfig) -> MoEConfig | None:
    """The MoE block of every layer (`enable_moe_block`: the 26B-A4B), None without it."""
    if not getattr(hf, "enable_moe_block", False):
        return None
    experts, top_k, ffn = hf.num_experts, hf.top_k_experts, hf.moe_intermediate_size
    require(experts is not None and experts >= 1, "num_experts", f"{experts}: the MoE block needs experts")
    require(top_k is not None and 1 <= top_k <= experts, "top_k_experts",
            f"{top_k} must be between 1 and num_experts={experts}")
    require(ffn is not None and ffn >= 1, "moe_intermediate_size", f"{ffn}: the experts need a size")
    # transformers weighs each expert's output with the fp32 weights and casts the product back (`combine_fp32`).
    return MoEConfig(num_experts=experts, top_k=top_k, expert_ffn_size=ffn, norm_topk_prob=True,
                     sparse_layers=list(range(hf.num_hidden_layers)), combine_fp32=True, fused_experts=True,
                     router_scales=True, beside_dense=True)


def normalise(hf: PretrainedConfig) -> ModelConfig:
    with global_values(hf):
        return _normalise(hf)


def _normalise(hf: PretrainedConfig) -> ModelConfig:
    rope_per_layer_type(hf, also=("proportional",))
    # 'vision' (the released 26B and 31B): image tokens attend both ways; text, all hfmeg trains on, is causal.
    cfg = gemma_switches(hf, decoder_config(hf, window=layer_types_window, qk_norm=True, moe=moe_block,
                                            act_field=ACT_FIELD), causal_on_text=("vision",))
    # transformers' full layers are those `layer_types` names full_attention (as `layer_types_window` reads them).
    full = tuple(i for i, t in enumerate(hf.layer_types) if t == "full_attention")
    sources = kv_sources(hf)
    wide = tuple(i for i, src in enumerate(sources) if src != i) if getattr(hf, "use_double_wide_mlp", False) else ()
    return replace(cfg, rope_per_layer_type=True, attn_softcap=None, norm_offset=False, norm_fp32_scale=True,
                   v_norm=True, query_pre_attn_scalar=1.0, global_attention=global_attention(hf, full), layer_scalar=True,
                   per_layer_input_size=per_layer_input_size(hf), kv_source=sources, wide_mlp_layers=wide)


def per_layer_input_size(hf: PretrainedConfig) -> int:
    """The per-layer inputs' width (`hidden_size_per_layer_input`; 0 or null: none)."""
    size = getattr(hf, "hidden_size_per_layer_input", None) or 0
    vocab = getattr(hf, "vocab_size_per_layer_input", None)
    require(not size or vocab == hf.vocab_size, "vocab_size_per_layer_input",
            f"{vocab}: hfmeg splits the per-layer table's rows over TP as the token embedding's, so it needs "
            f"vocab_size ({hf.vocab_size}), as the published E2B and E4B have")
    return size


def kv_sources(hf: PretrainedConfig) -> tuple[int, ...]:
    """Each layer's KV source under `num_kv_shared_layers` n (empty: none): the last n layers reuse the keys and
    values of the last layer before them of their own type (transformers' `kv_sharing_modes`, 'reuse'/'store')."""
    n, layers = getattr(hf, "num_kv_shared_layers", None) or 0, hf.num_hidden_layers
    if not n:
        return ()
    require(0 < n < layers, "num_kv_shared_layers", f"{n}: between 1 and num_hidden_layers - 1 ({layers - 1}) "
            "layers can reuse the keys and values of the layers before them")
    first, types = layers - n, hf.layer_types
    sources = list(range(layers))
    for i in range(first, layers):
        own = [j for j in range(first) if types[j] == types[i]]
        require(bool(own), "num_kv_shared_layers", f"layer {i} ({types[i]}) reuses keys and values, but no layer "
                f"before layer {first} is a {types[i]} layer to take them from")
        sources[i] = own[-1]
    return tuple(sources)


def _moe_rules(cfg: ModelConfig, i: int, experts: Collection[int]) -> list[TensorRule]:
    """The MoE block of layer i (`models/moe.py`, Gemma 4's): transformers names it beside `mlp`, not in it
    (`router.proj`, `router.scale`, `router.per_expert_scale`, `experts.gate_up_proj` `[E, 2F, H]` each expert's
    [gate; up], `experts.down_proj` `[E, H, F]`, and three norms), and always holds and saves the experts stacked."""
    m, h = cfg.moe, cfg.hidden_size
    E, f = m.num_experts, m.expert_ffn_size
    p, L = layer_prefix(i), f"layers.{i}."
    rules = [TensorRule(L + "moe.router.weight", (p + "router.proj.weight",), "replicated", shapes=((E, h),)),
             TensorRule(L + "moe.router_scale", (p + "router.scale",), "replicated", shapes=((h,),)),
             TensorRule(L + "moe.per_expert_scale", (p + "router.per_expert_scale",), "replicated", shapes=((E,),)),
             TensorRule(L + "moe.expert_norm.weight", (p + "pre_feedforward_layernorm_2.weight",), "replicated"),
             TensorRule(L + "dense_out_norm.weight", (p + "post_feedforward_layernorm_1.weight",), "replicated"),
             TensorRule(L + "moe_out_norm.weight", (p + "post_feedforward_layernorm_2.weight",), "replicated")]
    # One stacked HF tensor at a time, all its experts' slices together: each is read once (rules.rule_tensors).
    rules += [TensorRule(f"{L}moe.experts.{e}.fc1.weight", (p + "experts.gate_up_proj",), "replicated",
                         shapes=((E, 2 * f, h),), expert=e) for e in experts]
    rules += [TensorRule(f"{L}moe.experts.{e}.fc2.weight", (p + "experts.down_proj",), "replicated",
                         shapes=((E, h, f),), expert=e) for e in experts]
    return rules


def _layer_rules(cfg: ModelConfig, i: int, experts: Collection[int]) -> list[TensorRule]:
    rules = layer_rules(cfg, i, experts, moe_rules=_moe_rules)
    if not cfg.per_layer_input_size:
        return rules
    p, L, h, d = layer_prefix(i), f"layers.{i}.per_layer.", cfg.hidden_size, cfg.per_layer_input_size
    return rules + [TensorRule(L + "gate.weight", (p + "per_layer_input_gate.weight",), "replicated", shapes=((d, h),)),
                    TensorRule(L + "projection.weight", (p + "per_layer_projection.weight",), "replicated",
                               shapes=((h, d),)),
                    TensorRule(L + "norm.weight", (p + "post_per_layer_input_norm.weight",), "replicated")]


def _first_stage_rules(cfg: ModelConfig) -> list[TensorRule]:
    """The per-layer input tables (`models/per_layer_inputs.py`), none without them."""
    if not cfg.per_layer_input_size:
        return []
    d, width, L = cfg.per_layer_input_size, cfg.num_layers * cfg.per_layer_input_size, "per_layer_inputs."
    return [TensorRule(L + "embed.weight", ("model.embed_tokens_per_layer.weight",), "vocab",
                       shapes=((cfg.vocab_size, width),)),
            TensorRule(L + "projection.weight", ("model.per_layer_model_projection.weight",), "replicated",
                       shapes=((width, cfg.hidden_size),)),
            TensorRule(L + "norm.weight", ("model.per_layer_projection_norm.weight",), "replicated", shapes=((d,),))]


# LoRA: peft's names for the attention and the dense MLP; the MoE block's router and experts are not adapted.
GEMMA4 = FamilySpec(("gemma4_text",), "Gemma4ForCausalLM", normalise, _layer_rules, embedding="model.embed_tokens.weight",
                    final_norm="model.norm", peft=PeftNames(PROJECTIONS), first_stage=_first_stage_rules)
