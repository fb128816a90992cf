"""The model config hfmeg computes with, normalised from a Hugging Face config.

Every HF field that changes the maths is read here, once; everything downstream
(model, conversion, optimizer) reads `ModelConfig` and never the HF dict. Fields we
cannot honour raise `UnsupportedConfigError` naming the field, at build time.

RoPE parameters stay with the HF config object: `transformers` already normalises
v4 keys (`rope_theta`, `rope_scaling`) and v5 keys (`rope_parameters`) into one
`rope_parameters` dict, and its `ROPE_INIT_FUNCTIONS` are the reference for every
scaling type, so we call them rather than re-deriving the formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from .errors import UnsupportedConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
LLAMA_LIKE = ("llama", "mistral", "qwen2")
GELU_ACTS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass
class ModelConfig:
    """Architecture of a decoder-only model, independent of any parallel layout."""

    model_type: str  # HF model_type: llama | mistral | qwen2 | gpt2
    hidden_size: int
    ffn_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    norm: str  # "rms" | "layer"
    norm_eps: float
    activation: str  # "silu" | "gelu" | "gelu_tanh"
    gated_mlp: bool  # SwiGLU (fused gate/up) vs a plain two-layer MLP
    positions: str  # "rope" | "learned"
    qkv_bias: bool
    out_bias: bool  # bias on the attention output projection
    mlp_bias: bool
    tie_embeddings: bool
    attn_scale_inverse_layer: bool = False  # GPT-2 `scale_attn_by_inverse_layer_idx`
    attn_scale_weights: bool = True  # GPT-2 `scale_attn_weights`
    sliding_window: int | None = None  # Mistral: sequences longer than this are refused
    bos_token_id: int | None = None
    hf_config: PretrainedConfig | None = field(default=None, repr=False, compare=False)

    @property
    def arch(self) -> str:
        """The weight-name family: 'llama' for llama/mistral/qwen2, else 'gpt2'."""
        return "llama" if self.model_type in LLAMA_LIKE else "gpt2"

    def padded_vocab(self, tp: int, multiple: int = 128) -> int:
        """Vocabulary padded so that every TP rank holds `multiple`-aligned equal rows."""
        step = multiple * tp
        return int(math.ceil(self.vocab_size / step) * step)

    def attn_scale(self, layer: int) -> float:
        scale = 1.0 / math.sqrt(self.head_dim) if self.attn_scale_weights else 1.0
        return scale / (layer + 1) if self.attn_scale_inverse_layer else scale

    def num_params(self) -> int:
        """Parameter count of the unpadded model (for MFU and reports)."""
        h, f, v = self.hidden_size, self.ffn_size, self.vocab_size
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        attn = qkv + self.num_heads * self.head_dim * h
        mlp = (3 if self.gated_mlp else 2) * h * f
        norms = 2 * h * (2 if self.norm == "layer" else 1)
        per_layer = attn + mlp + norms
        emb = v * h * (1 if self.tie_embeddings else 2)
        pos = self.max_positions * h if self.positions == "learned" else 0
        return self.num_layers * per_layer + emb + pos + h

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "hf_config"}


def load_hf_config(path: str | Path) -> PretrainedConfig:
    """Read `config.json` from a local folder with transformers (no network)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise UnsupportedConfigError(f"{path}: no config.json found")
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise UnsupportedConfigError(f"{path / 'config.json'}: {e}") from e


def _require(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise UnsupportedConfigError(f"config.json field {where}: {msg}")


def _rope_check(hf: PretrainedConfig) -> None:
    params = getattr(hf, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    _require(
        rope_type in SUPPORTED_ROPE_TYPES,
        "rope_parameters.rope_type",
        f"{rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})",
    )
    _require(
        params.get("partial_rotary_factor", 1.0) == 1.0,
        "partial_rotary_factor",
        "partial rotary embeddings are not supported",
    )


def _from_llama_like(hf: PretrainedConfig) -> ModelConfig:
    t = hf.model_type
    _rope_check(hf)
    act = getattr(hf, "hidden_act", "silu")
    _require(act == "silu", "hidden_act", f"{act!r} is not supported for {t} (only 'silu')")
    pretraining_tp = getattr(hf, "pretraining_tp", 1) or 1
    _require(pretraining_tp == 1, "pretraining_tp", "only 1 is supported")
    heads = hf.num_attention_heads
    kv = getattr(hf, "num_key_value_heads", None) or heads
    _require(heads % kv == 0, "num_key_value_heads", f"{kv} does not divide num_attention_heads={heads}")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    sliding = None
    if t == "mistral":
        sliding = getattr(hf, "sliding_window", None)
    if t == "qwen2":
        _require(
            not getattr(hf, "use_sliding_window", False),
            "use_sliding_window",
            "Qwen2 sliding-window attention changes results and is not supported",
        )
    qkv_bias = True if t == "qwen2" else bool(getattr(hf, "attention_bias", False))
    out_bias = False if t == "qwen2" else bool(getattr(hf, "attention_bias", False))
    return ModelConfig(
        model_type=t,
        hidden_size=hf.hidden_size,
        ffn_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        vocab_size=hf.vocab_size,
        max_positions=hf.max_position_embeddings,
        norm="rms",
        norm_eps=hf.rms_norm_eps,
        activation="silu",
        gated_mlp=True,
        positions="rope",
        qkv_bias=qkv_bias,
        out_bias=out_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        sliding_window=sliding,
        bos_token_id=getattr(hf, "bos_token_id", None),
        hf_config=hf,
    )


def _from_gpt2(hf: PretrainedConfig) -> ModelConfig:
    act = hf.activation_function
    _require(act in GELU_ACTS, "activation_function", f"{act!r} is not supported")
    _require(not getattr(hf, "add_cross_attention", False), "add_cross_attention", "not supported")
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


def model_config_from_hf(hf: PretrainedConfig) -> ModelConfig:
    """Normalise a transformers config; raise UnsupportedConfigError for what we cannot run."""
    t = getattr(hf, "model_type", None)
    if t in LLAMA_LIKE:
        return _from_llama_like(hf)
    if t == "gpt2":
        return _from_gpt2(hf)
    raise UnsupportedConfigError(
        f"config.json field model_type: {t!r} is not supported (supported: {', '.join(LLAMA_LIKE + ('gpt2',))})"
    )


def check_tp(cfg: ModelConfig, tp: int, *, sequence_parallel: bool = False) -> None:
    """Raise if `cfg` cannot be split `tp` ways (heads, KV heads, FFN)."""
    _require(cfg.num_heads % tp == 0, "num_attention_heads", f"{cfg.num_heads} is not divisible by TP={tp}")
    _require(cfg.num_kv_heads % tp == 0, "num_key_value_heads", f"{cfg.num_kv_heads} is not divisible by TP={tp}")
    _require(cfg.ffn_size % tp == 0, "intermediate_size", f"{cfg.ffn_size} is not divisible by TP={tp}")
