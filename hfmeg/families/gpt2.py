"""GPT-2: LayerNorms with biases, learned positions, a plain GELU MLP, and its linear weights stored as
`Conv1D` (`[in, out]`: `transpose=True` turns them into `[out, in]` on the way in and back on the way out),
Q, K and V in one `c_attn`. LoRA is not built for it (`peft = None`)."""

from __future__ import annotations

from typing import Collection

from transformers import PretrainedConfig

from ..config import ModelConfig, require
from .spec import FamilySpec, TensorRule

GELU_ACTS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


def normalise(hf: PretrainedConfig) -> ModelConfig:
    act = hf.activation_function
    require(act in GELU_ACTS, "activation_function", f"{act!r} is not supported")
    require(not getattr(hf, "add_cross_attention", False), "add_cross_attention", "not supported")
    h = hf.n_embd
    return ModelConfig(
        model_type="gpt2",
        hidden_size=h,
        ffn_size=hf.n_inner or 4 * h,
        num_layers=hf.n_layer,
        num_heads=hf.n_head,
        num_kv_heads=hf.n_head,
        head_dim=h // hf.n_head,
        vocab_size=hf.vocab_size,
        max_positions=hf.n_positions,
        norm="layer",
        norm_eps=hf.layer_norm_epsilon,
        activation="gelu_tanh" if GELU_ACTS[act] == "tanh" else "gelu",
        gated_mlp=False,
        positions="learned",
        qkv_bias=True,
        out_bias=True,
        mlp_bias=True,
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        attn_scale_inverse_layer=bool(hf.scale_attn_by_inverse_layer_idx),
        attn_scale_weights=bool(hf.scale_attn_weights),
        bos_token_id=getattr(hf, "bos_token_id", None),
        hf_config=hf,
    )


def layer_rules(cfg: ModelConfig, i: int, experts: Collection[int]) -> list[TensorRule]:
    p, L = f"transformer.h.{i}.", f"layers.{i}."
    rules = []
    for ours, theirs in (("input_norm", "ln_1"), ("post_attn_norm", "ln_2")):
        for w in ("weight", "bias"):
            rules.append(TensorRule(f"{L}{ours}.{w}", (f"{p}{theirs}.{w}",), "replicated"))
    rules += [
        TensorRule(L + "attn.qkv.weight", (p + "attn.c_attn.weight",), "qkv", transpose=True),
        TensorRule(L + "attn.qkv.bias", (p + "attn.c_attn.bias",), "qkv"),
        TensorRule(L + "attn.out.weight", (p + "attn.c_proj.weight",), "cols", transpose=True),
        TensorRule(L + "attn.out.bias", (p + "attn.c_proj.bias",), "replicated"),
        TensorRule(L + "mlp.fc1.weight", (p + "mlp.c_fc.weight",), "rows", transpose=True),
        TensorRule(L + "mlp.fc1.bias", (p + "mlp.c_fc.bias",), "rows"),
        TensorRule(L + "mlp.fc2.weight", (p + "mlp.c_proj.weight",), "cols", transpose=True),
        TensorRule(L + "mlp.fc2.bias", (p + "mlp.c_proj.bias",), "replicated"),
    ]
    return rules


def causal_mask_buffer(name: str, config: dict) -> bool:
    """The causal masks the original GPT-2 checkpoints hold per layer (`attn.bias`, `attn.masked_bias`): transformers
    ignores them on loading (`_keys_to_ignore_on_load_unexpected`) and builds its own mask, so they are carried."""
    return name.endswith((".attn.bias", ".attn.masked_bias"))


GPT2 = FamilySpec(("gpt2",), "GPT2LMHeadModel", normalise, layer_rules, embedding="transformer.wte.weight", final_norm="transformer.ln_f",
                  position_embedding="transformer.wpe.weight", carried=causal_mask_buffer)
