"""Tiny random HF checkpoints, saved with transformers, for tests of every family."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, DeepseekV3Config, Gemma2Config, Gemma3TextConfig, Gemma4TextConfig,
                          GPT2Config, GptOssConfig, LlamaConfig, MistralConfig, MixtralConfig, Olmo2Config, Olmo3Config,
                          Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3_5TextConfig, Qwen3Config, Qwen3MoeConfig,
                          SmolLM3Config)

from hfmeg.models import random_init

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
STORIES = ASSETS / "models" / "stories260K"

# Every dense family `tiny_config` builds; llama_tied has tied embeddings and a vocabulary (32001)
# that needs padding under every TP size; qwen3 has QK-norm and a head_dim (16) that is not hidden / heads (8);
# mistral has a sliding window of 4 tokens on every layer, shorter than the test rows and packed documents;
# smollm3 skips RoPE on every 2nd layer (NoPE), has the same window on those layers only, and ties its embeddings; phi3 has fused GQA `qkv_proj` (8 query heads,
# 4 KV heads: the fused tensor is not three equal parts) and `gate_up_proj`, and RoPE on 3/4 of each head;
# gemma2 has the window on every other layer, four (1 + w) norms a layer, GeGLU, a scaled embedding, an attention
# scale from query_pre_attn_scalar (16, not head_dim 8) and soft-capping of scores and logits with caps small
# enough to bite (the tiny model's scores reach ~0.08, its logits ~0.7); gemma3 adds (1 + w) QK-norm and RoPE per
# layer type (sliding layers theta 1e4, full layers 1e6 with linear scaling), and no attention cap (transformers'
# Gemma 3 ignores attn_logit_softcapping); gemma4 is gemma3 with w (not 1 + w) norms in fp32, a weightless norm on
# the values, attention scale 1 and its per-layer embeddings switched off; olmo2 has norms after each sublayer only and QK-norm over the whole
# q and k projections (GQA: 8 query, 4 KV heads, so each TP2 rank holds a slice of both norms' weights); olmo3
# adds the window on its first layer and RoPE per layer type (as gemma3's).
RANDOM_KINDS = ("llama3", "mistral", "qwen2", "gpt2", "llama_tied", "qwen3", "smollm3", "phi3", "gemma2", "gemma3",
                "gemma4", "olmo2", "olmo3")

WINDOW = 4
_GEMMA = dict(head_dim=8, sliding_window=WINDOW, query_pre_attn_scalar=16, attn_logit_softcapping=0.02,
              final_logit_softcapping=0.5)
_LAYER_TYPES = ["sliding_attention", "full_attention"]
_ROPES = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
          "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}
_OLMO = dict(pad_token_id=None, bos_token_id=1, eos_token_id=2)
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=4, vocab_size=300, max_position_embeddings=128)
# Qwen3.5 (not in RANDOM_KINDS: its tests are tests/test_qwen3_5.py): layers linear, linear, linear, full; 4 key
# heads serving 8 value heads (2 each) of 8 dims in the linear layers, gated attention heads of 16 with RoPE on 4.
_QWEN3_5 = dict(head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
                linear_value_head_dim=8)

# MoE families (not in RANDOM_KINDS: their tests are tests/test_moe*.py): 4 experts, top-2, the
# load-balancing loss on with a coefficient large enough to show in every router gradient.
# qwen2_moe: layer 0 dense (decoder_sparse_step 2), a shared expert; qwen3_moe: q/k norms,
# norm_topk_prob, layer 0 dense through mlp_only_layers.
MOE_KINDS = ("mixtral", "qwen2_moe", "qwen3_moe")
_MOE = dict(_COMMON, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1)
_QWEN_MOE = dict(_MOE, num_experts=4, moe_intermediate_size=16)

# deepseek_v3 (tests/test_deepseek_v3.py): MLA with a query latent, 4 heads of q/k 8 + 4 (rotated, interleaved) and
# v 6 wide, YaRN with mscale != mscale_all_dim (both the RoPE tables' and the softmax scale's factors); 3 layers, the
# first dense, 4 routed experts in 2 groups (topk_group 1), top-2, one shared expert, no MTP layer.
_DEEPSEEK_V3 = dict(_COMMON, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                    v_head_dim=6, moe_intermediate_size=16, n_routed_experts=4, n_group=2, topk_group=1,
                    num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                    num_mtp_layers=0, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                       "original_max_position_embeddings": 32, "mscale": 0.8,
                                                       "mscale_all_dim": 1.0})
# gpt_oss (tests/test_gpt_oss.py): attention sinks, Q/K/V/O biases, the window on its first layer (sliding, full),
# YaRN, a router with a bias, experts with biases and a SwiGLU clamped at a limit small enough to bite (its expert
# pre-activations reach ~0.4).
_GPT_OSS = dict(_MOE, num_local_experts=4, intermediate_size=16, head_dim=8, sliding_window=WINDOW,
                layer_types=_LAYER_TYPES, swiglu_limit=0.1,
                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32})


def tiny_config(kind: str, **overrides):
    if kind == "llama3":
        cfg = LlamaConfig(**_COMMON, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    elif kind == "llama_tied":
        cfg = LlamaConfig(**{**_COMMON, "vocab_size": 32001}, tie_word_embeddings=True)
    elif kind == "mistral":
        cfg = MistralConfig(**_COMMON, sliding_window=WINDOW)
    elif kind == "qwen2":
        cfg = Qwen2Config(**_COMMON)
    elif kind == "qwen3":
        cfg = Qwen3Config(**_COMMON, head_dim=16)
    elif kind == "smollm3":
        cfg = SmolLM3Config(**_COMMON, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=WINDOW,
                            pad_token_id=None, bos_token_id=1, eos_token_id=2)
    elif kind == "phi3":
        cfg = Phi3Config(**_COMMON, pad_token_id=None, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75})
    elif kind == "gemma2":
        cfg = Gemma2Config(**_COMMON, **_GEMMA)
    elif kind == "gemma3":
        cfg = Gemma3TextConfig(**_COMMON, **{**_GEMMA, "attn_logit_softcapping": None}, layer_types=_LAYER_TYPES,
                               rope_parameters=_ROPES)
    elif kind == "gemma4":
        cfg = Gemma4TextConfig(**_COMMON, head_dim=8, global_head_dim=8, sliding_window=WINDOW, layer_types=_LAYER_TYPES,
                               rope_parameters=_ROPES, final_logit_softcapping=0.5, hidden_size_per_layer_input=0)
    elif kind == "olmo2":
        cfg = Olmo2Config(**_COMMON, **_OLMO)
    elif kind == "olmo3":
        cfg = Olmo3Config(**_COMMON, **_OLMO, sliding_window=WINDOW, layer_types=_LAYER_TYPES, rope_parameters=_ROPES)
    elif kind == "qwen3_5":
        cfg = Qwen3_5TextConfig(**{**_COMMON, "num_hidden_layers": 4}, **_QWEN3_5)
    elif kind == "qwen3_5_moe":
        from transformers import Qwen3_5MoeTextConfig
        moe = {k: v for k, v in _QWEN_MOE.items() if k != "intermediate_size"}  # no dense MLP anywhere
        cfg = Qwen3_5MoeTextConfig(**{**moe, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8,
                                      "num_key_value_heads": 4}, **_QWEN3_5, shared_expert_intermediate_size=24)
    elif kind == "gpt2":
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=8, vocab_size=300, n_positions=128)
    elif kind == "mixtral":
        cfg = MixtralConfig(**_MOE, num_local_experts=4)
    elif kind == "qwen2_moe":
        cfg = Qwen2MoeConfig(**_QWEN_MOE, decoder_sparse_step=2, shared_expert_intermediate_size=24)
    elif kind == "gpt_oss":
        cfg = GptOssConfig(**_GPT_OSS)
    elif kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(**_QWEN_MOE, norm_topk_prob=True, mlp_only_layers=[0])
    elif kind == "deepseek_v3":
        cfg = DeepseekV3Config(**_DEEPSEEK_V3)
    else:
        raise ValueError(kind)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def save_tiny(kind: str, folder: Path, seed: int = 0, **overrides) -> Path:
    """Save a random tiny checkpoint of `kind` to `folder` (fp32 safetensors)."""
    torch.manual_seed(seed)
    cfg = tiny_config(kind, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    perturb(model)
    model.save_pretrained(folder)
    return folder


@torch.no_grad()
def perturb(model: torch.nn.Module) -> None:
    """Give norms and biases non-trivial values so their layout is tested, and routers clear choices."""
    for name, p in model.named_parameters():
        if "norm" in name or "ln_" in name or name.endswith("bias"):
            p.add_(torch.randn_like(p) * 0.1)
        if name.endswith(("gate.weight", "shared_expert_gate.weight", "router.weight")):
            # Routers 10x HF's init: clear top-k choices, so fp32 rounding differences cannot flip them.
            p.mul_(10.0)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # DeepSeek's: large enough to change choices
            b.normal_(0, 0.5)


WRAPPED_KINDS = ("gemma3", "mistral3", "gemma4", "qwen3_5", "qwen3_5_moe")


def save_tiny_wrapped(kind: str, folder: Path, seed: int = 0, **text) -> Path:
    """A random tiny multimodal checkpoint whose language model is tiny `kind` (its overrides `text`) under
    `text_config`: Gemma 3's (`Gemma3ForConditionalGeneration`, a one-layer SigLIP vision tower and projector),
    Mistral 3's (Pixtral) or Gemma 4's (its own vision tower, no audio), as `save_pretrained` names them (the
    first two with transformers-v4 names, `language_model.model.…`; Gemma 4 with `model.language_model.…`)."""
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma4Config, Gemma4ForConditionalGeneration,
                              Mistral3Config, Mistral3ForConditionalGeneration)

    torch.manual_seed(seed)
    language = {k: v for k, v in tiny_config("mistral" if kind == "mistral3" else kind, **text).to_dict().items()
                if k != "per_layer_config"} | text
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    if kind == "gemma3":
        model = Gemma3ForConditionalGeneration(Gemma3Config(
            text_config=language, vision_config=dict(vision, image_size=28, patch_size=14), mm_tokens_per_image=4,
            image_token_index=299, boi_token_index=297, eoi_token_index=298))
    elif kind == "mistral3":
        model = Mistral3ForConditionalGeneration(Mistral3Config(
            text_config=language, vision_config=dict(vision, image_size=28, patch_size=14, head_dim=16,
                                                     model_type="pixtral"), image_token_index=299))
    elif kind == "gemma4":
        model = Gemma4ForConditionalGeneration(Gemma4Config(
            text_config=dict(language, global_head_dim=language["head_dim"]), audio_config=None,
            vision_config=dict(vision, num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                               position_embedding_size=64)))
    elif kind in ("qwen3_5", "qwen3_5_moe"):
        from transformers import (Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                                  Qwen3_5MoeForConditionalGeneration)
        config, wrapper = (Qwen3_5Config, Qwen3_5ForConditionalGeneration) if kind == "qwen3_5" else (
            Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration)
        model = wrapper(config(
            text_config=language, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                     patch_size=4, out_hidden_size=language["hidden_size"],
                                                     num_position_embeddings=16),
            image_token_id=299, video_token_id=298, vision_start_token_id=297, vision_end_token_id=296))
    else:
        raise ValueError(kind)
    model.save_pretrained(folder)
    return folder


def reference_attention(folder: Path) -> str:
    """The transformers attention to compare a saved tiny checkpoint with (`random_init.reference_attention`)."""
    from transformers import AutoConfig

    return random_init.reference_attention(AutoConfig.from_pretrained(folder))


def rewrite_config_v4(folder: Path) -> None:
    """Rewrite `config.json` with transformers-v4 RoPE keys (rope_theta + rope_scaling)."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    cfg["rope_scaling"] = params
    path.write_text(json.dumps(cfg, indent=2))
