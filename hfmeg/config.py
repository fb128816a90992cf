"""The model config hfmeg computes with, normalised from a Hugging Face config.

Every HF field that changes the maths is read once, by the model's family
(`hfmeg/families`, `model_config_from_hf`), into `ModelConfig`; everything downstream
(model, conversion, optimizer) reads `ModelConfig` and never the HF dict. Fields we
cannot honour raise `UnsupportedConfigError` naming the field, at build time.

RoPE parameters stay with the HF config object: `transformers` already normalises
v4 keys (`rope_theta`, `rope_scaling`) and v5 keys (`rope_parameters`) into one
`rope_parameters` dict, and its `ROPE_INIT_FUNCTIONS` are the reference for every
scaling type, so we call them rather than re-deriving the formulas.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from .errors import UnsupportedConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# The vocabulary is padded to a multiple of this x TP (Megatron's `make_vocab_size_divisible_by`): the one default,
# which the run config (`model.vocab_multiple`), conversion's `--vocab-multiple`, the layout and the planner read.
VOCAB_MULTIPLE = 128


def padded_vocab(rows: int, tp: int, multiple: int) -> int:
    """The vocabulary padded so that each of `tp` ranks holds an equal, `multiple`-aligned share of its rows
    (`parallel/splits.py` `Vocab` pads the tensors to it)."""
    step = multiple * tp
    return int(math.ceil(rows / step) * step)


@dataclass
class MoEConfig:
    """The mixture-of-experts part of a model (see `hfmeg/models/moe.py` for the algorithm).

    `sparse_layers` lists the layers whose MLP is the MoE block (Qwen's `decoder_sparse_step`
    and `mlp_only_layers` resolved once, here); the others keep a dense MLP of
    `ModelConfig.ffn_size`. `combine_fp32`: Mixtral weighs expert outputs with the fp32
    routing weights, Qwen casts them to the compute dtype first (matters only below fp32).
    """

    num_experts: int
    top_k: int
    expert_ffn_size: int
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    sparse_layers: list[int]
    combine_fp32: bool
    shared_expert_ffn_size: int = 0  # Qwen2-MoE's always-on expert, gated by sigmoid(shared_expert_gate(x)); 0: none
    router_aux_loss_coef: float = 0.0
    output_router_logits: bool = False  # add router_aux_loss_coef x the load-balancing loss to the training loss
    # How the HF checkpoint stores the experts: one tensor per expert (what `save_pretrained` writes), or
    # stacked per layer as transformers holds them in memory. Read from the checkpoint's tensor names, not
    # from config.json (`checkpoint.rules.with_expert_layout`), and kept so that export writes it back.
    fused_experts: bool = False
    experts_field: str = "num_experts"  # the config.json field of the expert count (Mixtral: num_local_experts)
    # DeepSeek-V3's routing (`models/routing.py`): sigmoid scores; the experts in `n_group` groups of which the
    # `topk_group` best (by their two best scores) are eligible; a per-expert correction bias added to the scores
    # for the choice only, moved after each step towards balance (`score_bias_update`); the weights times
    # `routed_scaling_factor`. `shared_expert_gate`: Qwen2-MoE scales its shared expert by a learned sigmoid gate,
    # DeepSeek adds its shared experts ungated.
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = False
    shared_expert_gate: bool = True
    # gpt-oss: the router's logits have a bias; each expert's fc1 and fc2 have biases; its SwiGLU is clamped,
    # (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = clamp(gate, max=limit) (None: plain SwiGLU).
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    # Gemma 4's block (`enable_moe_block`): the router reads the layer's residual stream RMS-normalised with no weight,
    # times a learned per-channel `scale` and hidden^-0.5, and each chosen expert's renormalised weight is times its
    # learned `per_expert_scale` (`router_scales`); the experts read their own norm of the residual stream and run
    # beside the layer's dense MLP, the two outputs each normed and summed (`beside_dense`, `models/decoder.py`).
    router_scales: bool = False
    beside_dense: bool = False


@dataclass
class MLAConfig:
    """DeepSeek's multi-head latent attention (`hfmeg/models/latent_attention.py`): the queries from a rank
    `q_lora_rank` latent (None: one projection of the hidden state), the keys' and values' non-rotated parts from a
    rank `kv_lora_rank` latent, and one rotated key part of `qk_rope_head_dim` shared by every head. A query or key
    head is `qk_nope_head_dim + qk_rope_head_dim` wide (`ModelConfig.head_dim`), a value head `v_head_dim`.
    `rope_interleave`: RoPE rotates the pairs (x0, x1), (x2, x3), ... and writes the even then the odd outputs, as
    DeepSeek's checkpoints lay the rotary dims out. `softmax_scale`: qk_head_dim^-0.5, times YaRN's mscale^2 where
    the RoPE scaling asks (transformers' `yarn_apply_mscale`)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float

    def num_params(self, hidden: int, heads: int) -> int:
        """One layer's attention parameters (projections and the two latent norms)."""
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = hidden * heads * qk if self.q_lora_rank is None else (
            hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * qk)
        kv = hidden * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * hidden


@dataclass
class LinearAttentionConfig:
    """Qwen3.5's Gated DeltaNet layers (`models/gated_deltanet.py`): which layers they are (the others attend
    in full), their key/query and value heads (each key head serves `value_heads // key_heads` consecutive value
    heads), head sizes and the short convolution's kernel."""

    layers: tuple[int, ...]
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @property
    def conv_channels(self) -> int:
        """The convolved channels: queries, keys and values, `[q; k; v]`."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def in_pieces(self) -> tuple[int, ...]:
        """The row counts of the fused input projection `[q; k; v; z; b; a]` (each split over TP by heads)."""
        key, value = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        return key, key, value, value, self.value_heads, self.value_heads


@dataclass
class AttentionShape:
    """One layer's attention shape where it is not the model's (`ModelConfig.global_attention`): its KV heads, its
    head size, and whether its values are its keys (`values_from_keys`: Gemma 4's `attention_k_eq_v`, no v_proj;
    the values are the raw key projection, before the key norm and RoPE)."""

    num_kv_heads: int
    head_dim: int
    values_from_keys: bool = False
    reused: bool = False  # Gemma 4's KV sharing: the layer attends with an earlier layer's keys and values

    @property
    def kv_parts(self) -> int:
        """The key/value blocks of each KV group in the fused QKV weight: k and v, k alone, or none (`reused`)."""
        return 0 if self.reused else 1 if self.values_from_keys else 2


@dataclass
class ModelConfig:
    """Architecture of a decoder-only model, independent of any parallel layout."""

    model_type: str  # HF model_type, for messages and the layout JSON: its family (`hfmeg/families`) decides the rest
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
    # A query at row position i sees keys j with i - w < j <= i (transformers' `sliding_window_overlay`) on every
    # layer but `full_attention_layers` (`layer_types`' full_attention ones); None: no window anywhere.
    sliding_window: int | None = None
    bos_token_id: int | None = None
    # The embedding row that never trains (transformers' `nn.Embedding(padding_idx=pad_token_id)`, every family
    # but GPT-2): its gradient is zero; its LM-head row, where tied, still trains. None: every row trains.
    pad_token_id: int | None = None
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head (before RoPE)
    # OLMo 2: the q/k norms span the whole projection (all heads of a token, weight heads * head_dim), not one head.
    qk_norm_whole: bool = False
    nope_layers: tuple[int, ...] = ()  # SmolLM3: the layers that apply no RoPE (`no_rope_layers` zeros)
    partial_rotary_factor: float = 1.0  # Phi-3/4: RoPE rotates the first `rotary_dim` dims of each head only
    full_attention_layers: tuple[int, ...] = ()
    # Gemma's switches: RMSNorm scales by (1 + w) in fp32 (the stored weight is w); the embedding is scaled by
    # sqrt(hidden) in its dtype; a norm on the attention's and on the MLP's output too (four per layer);
    # attention scores and final logits soft-capped (cap * tanh(x / cap)); the attention scale
    # query_pre_attn_scalar^-0.5. `rope_per_layer_type` (Gemma 3): the HF `rope_parameters` hold one entry per
    # layer type, sliding_attention for the windowed layers and full_attention for the others (`rope_key`).
    norm_offset: bool = False
    embed_scale: bool = False
    sandwich_norms: bool = False
    pre_norms: bool = True  # False (OLMo 2): no norm before attention and MLP, only the sandwich's output norms
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    rope_per_layer_type: bool = False
    # Gemma 4: RMSNorms scale by w in fp32 and round once (not 1 + w, and not in the input dtype as LLaMA's); the
    # values are RMS-normalised over each head with no weight, as the q/k norms are with theirs.
    norm_fp32_scale: bool = False
    v_norm: bool = False
    # Gemma 4: each layer's output times its `layer_scalar` (one value a layer, held and saved by transformers as a
    # buffer: loaded and exported as a frozen parameter, never trained).
    layer_scalar: bool = False
    # gpt-oss: a learned logit per query head joins each query's softmax normaliser (an attention sink) and takes
    # no value: softmax over [scores, sink], the sink's column dropped.
    attn_sinks: bool = False
    # Qwen3.5: the attention output times sigmoid of a gate the q projection also makes (per head, `[q_h; gate_h]`
    # rows), and Gated DeltaNet layers in place of attention on `linear_attention.layers`.
    attn_output_gate: bool = False
    # Ministral 3 (Llama 4's attention scaling): each query, after RoPE, times 1 + beta * log(1 + floor(p / period)) at
    # position p, so 1 within the first `period` positions (`rope.query_scale`); None: no scaling.
    query_scale_beta: float | None = None
    query_scale_period: int | None = None
    linear_attention: LinearAttentionConfig | None = None
    # Gemma 4: the full-attention layers' (those without a window, as `rope_key` reads them) own shape, transformers' per-layer
    # `head_dim`/`num_key_value_heads` overrides (`global_head_dim`, `num_global_key_value_heads`) and
    # `attention_k_eq_v`; None: every layer has the model's (`attention_shape`).
    global_attention: AttentionShape | None = None
    # Gemma 4 E2B/E4B. `per_layer_input_size`: the values per layer and token of the per-layer input embeddings
    # (`models/per_layer_inputs.py`; 0: none). `kv_source[i]`: the layer whose keys and values layer i attends with
    # (KV sharing: i itself where it computes its own; empty: every layer its own). `wide_mlp_layers`: the layers
    # whose MLP is 2 x `ffn_size` wide (`use_double_wide_mlp`: the KV-sharing ones).
    per_layer_input_size: int = 0
    kv_source: tuple[int, ...] = ()
    wide_mlp_layers: tuple[int, ...] = ()
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None  # DeepSeek's latent attention instead of the fused-QKV one
    hf_config: PretrainedConfig | None = field(default=None, repr=False, compare=False)

    def padded_vocab(self, tp: int, multiple: int = VOCAB_MULTIPLE) -> int:
        return padded_vocab(self.vocab_size, tp, multiple)

    def attention_shape(self, layer: int | None) -> AttentionShape:
        """Layer `layer`'s KV heads, head size and value source (None: the model's, as every layer but Gemma 4's
        full-attention ones has it)."""
        if self.reuses_kv(layer):  # the producing layer's shape (of the same layer type), with no K/V rows
            return replace(self.attention_shape(self.kv_source[layer]), reused=True)
        if self.global_attention is not None and layer is not None and self.window(layer) is None:
            return self.global_attention
        return AttentionShape(self.num_kv_heads, self.head_dim)

    def reuses_kv(self, layer: int | None) -> bool:
        """Whether layer `layer` attends with an earlier layer's keys and values (`kv_source`)."""
        return bool(self.kv_source) and layer is not None and self.kv_source[layer] != layer

    def stores_kv(self, layer: int) -> bool:
        """Whether a later layer attends with layer `layer`'s keys and values."""
        return any(src == layer for i, src in enumerate(self.kv_source) if i != layer)

    def ffn_size_of(self, layer: int | None) -> int:
        """Layer `layer`'s dense MLP width (None: the model's)."""
        return self.ffn_size * (2 if layer in self.wide_mlp_layers else 1)

    @property
    def stage_width(self) -> int:
        """The features a pipeline stage sends the next per token: the hidden state, and with per-layer input
        embeddings every layer's per-layer input after it (`models/per_layer_inputs.py`)."""
        return self.hidden_size + self.num_layers * self.per_layer_input_size

    def attn_scale(self, layer: int) -> float:
        if self.mla is not None:
            return self.mla.softmax_scale
        if self.query_pre_attn_scalar is not None:
            return self.query_pre_attn_scalar ** -0.5  # as transformers' Gemma computes it
        d = self.attention_shape(layer).head_dim
        scale = 1.0 / math.sqrt(d) if self.attn_scale_weights else 1.0
        return scale / (layer + 1) if self.attn_scale_inverse_layer else scale

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates (transformers' `int(head_dim * partial_rotary_factor)`; MLA: its
        rotated part)."""
        return self.rotary_dim_of(None)

    def rotary_dim_of(self, layer: int | None) -> int:
        """`rotary_dim` of layer `layer`'s heads (Gemma 4's full-attention heads are wider: `attention_shape`)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.attention_shape(layer).head_dim * self.partial_rotary_factor)

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, None where it attends over the whole causal past."""
        return None if layer in self.full_attention_layers else self.sliding_window

    def rope_key(self, layer: int) -> str | None:
        """Which entry of the HF `rope_parameters` layer `layer` rotates with (None: the one set of them)."""
        if not self.rope_per_layer_type:
            return None
        return "full_attention" if self.window(layer) is None else "sliding_attention"

    def uses_rope(self, layer: int) -> bool:
        return self.positions == "rope" and layer not in self.nope_layers

    @property
    def q_rows(self) -> int:
        """Rows per query head in the fused QKV weight: the head, and its output gate where there is one."""
        return self.q_rows_of(None)

    def q_rows_of(self, layer: int | None) -> int:
        """`q_rows` of layer `layer` (its head size: `attention_shape`)."""
        return self.attention_shape(layer).head_dim * (2 if self.attn_output_gate else 1)

    def is_linear(self, layer: int) -> bool:
        """Whether layer `layer` is a Gated DeltaNet layer rather than attention."""
        return self.linear_attention is not None and layer in self.linear_attention.layers

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the mixture-of-experts block."""
        return self.moe is not None and layer in self.moe.sparse_layers

    def kv_replicas(self, tp: int, layer: int | None = None) -> int:
        """How many TP ranks hold each KV head of layer `layer` (None: the model's shape): 1 when TP divides its
        KV heads, else TP / KV heads (`attention_shape`: Gemma 4's full-attention layers have fewer).

        With fewer KV heads than TP ranks each rank keeps a full copy of the one KV head its query
        heads use (as Megatron-Core does for fewer query groups than ranks): `models/attention.py`."""
        a = self.attention_shape(layer)
        return 1 if a.kv_parts == 0 else max(1, tp // a.num_kv_heads)  # a layer reusing K/V holds no K/V rows

    def local_kv_heads(self, tp: int, layer: int | None = None) -> int:
        """The KV heads one TP rank computes in layer `layer` (copies included)."""
        return max(1, self.attention_shape(layer).num_kv_heads // tp)

    @property
    def adds_aux_loss(self) -> bool:
        """Whether the model adds the router's load-balancing loss to the training loss."""
        return self.moe is not None and self.moe.output_router_logits

    def num_params(self) -> int:
        """Parameter count of the unpadded model, every expert included (for MFU and reports; biases left out)."""
        h, v = self.hidden_size, self.vocab_size

        def attention(layer: int) -> int:
            if self.mla is not None:
                return self.mla.num_params(h, self.num_heads)
            a = self.attention_shape(layer)
            qkv = h * (self.num_heads * self.q_rows_of(layer) + a.kv_parts * a.num_kv_heads * a.head_dim)
            qk = (self.num_heads + a.num_kv_heads) * a.head_dim if self.qk_norm_whole else (
                (1 if a.reused else 2) * a.head_dim)  # a layer reusing K/V has no key norm
            return qkv + self.num_heads * a.head_dim * h + (qk if self.qk_norm else 0)
        dense = (3 if self.gated_mlp else 2) * h * self.ffn_size
        p = self.per_layer_input_size  # each layer's gate, projection and norm; the table, projection and norm
        per_layer = self.num_layers * (2 * h * p + h) + (v + h) * self.num_layers * p + p if p else 0
        norms = (2 * self.pre_norms + 2 * self.sandwich_norms) * h * (2 if self.norm == "layer" else 1)
        n_sparse = len(self.moe.sparse_layers) if self.moe else 0
        beside = self.moe is not None and self.moe.beside_dense  # Gemma 4: dense MLP, 3 norms, 2 scales more
        norms += self.layer_scalar  # Gemma 4's one frozen value a layer
        total = self.num_layers * norms + (self.num_layers if beside else self.num_layers - n_sparse) * dense
        total += len(self.wide_mlp_layers) * dense + per_layer
        la = self.linear_attention
        n_linear = len(la.layers) if la else 0
        total += sum(attention(i) for i in range(self.num_layers) if not self.is_linear(i))
        if la:  # in_proj, the convolution, A_log and dt_bias, the gated norm, out_proj
            total += n_linear * (h * sum(la.in_pieces()) + la.conv_channels * la.conv_kernel + 2 * la.value_heads
                                 + la.value_dim + la.value_heads * la.value_dim * h)
        if self.moe:
            m = self.moe
            shared = 3 * h * m.shared_expert_ffn_size + h * m.shared_expert_gate if m.shared_expert_ffn_size else 0
            total += n_sparse * (m.num_experts * h + m.num_experts * 3 * h * m.expert_ffn_size + shared)
            total += n_sparse * (4 * h + m.num_experts) if beside else 0
        emb = v * h * (1 if self.tie_embeddings else 2)
        pos = self.max_positions * h if self.positions == "learned" else 0
        return total + emb + pos + h

    def to_dict(self) -> dict[str, Any]:
        # Fields added after format version 1 appear only when set, so a dense model's
        # layout JSON (and the comparison with checkpoints written before them) is unchanged.
        # pad_token_id changes no tensor and no forward (only which embedding row trains): not layout.
        later = {f.name: f.default for f in fields(self) if f.name in LATER_FIELDS}
        out = {k: v for k, v in self.__dict__.items()
               if k not in later and k not in ("hf_config", "pad_token_id", "moe", "mla", "linear_attention",
                                               "global_attention")}
        for k, default in later.items():
            v = getattr(self, k)
            if v != default:
                out[k] = list(v) if isinstance(v, tuple) else v
        if self.moe is not None:  # experts_field: a name, not maths; the later MoE fields only when set
            defaults = {f.name: f.default for f in fields(MoEConfig) if f.name in MOE_LATER_FIELDS}
            out["moe"] = {k: v for k, v in asdict(self.moe).items()
                          if k != "experts_field" and (k not in defaults or v != defaults[k])}
        if self.linear_attention is not None:
            out["linear_attention"] = {k: list(v) if isinstance(v, tuple) else v
                                       for k, v in asdict(self.linear_attention).items()}
        if self.mla is not None:
            out["mla"] = asdict(self.mla)
        if self.global_attention is not None:
            out["global_attention"] = {k: v for k, v in asdict(self.global_attention).items() if k != "reused"}
        return out


# ModelConfig fields added after layout format version 1: written only when set (ModelConfig.to_dict).
LATER_FIELDS = ("qk_norm", "nope_layers", "partial_rotary_factor", "full_attention_layers", "norm_offset",
                "embed_scale", "sandwich_norms", "attn_softcap", "final_softcap", "query_pre_attn_scalar",
                "rope_per_layer_type", "qk_norm_whole", "pre_norms", "norm_fp32_scale", "v_norm", "attn_sinks",
                "attn_output_gate", "layer_scalar", "query_scale_beta", "query_scale_period", "per_layer_input_size",
                "kv_source", "wide_mlp_layers")
# MoEConfig fields added after the MoE families' first layout JSON: written only when set (ModelConfig.to_dict).
MOE_LATER_FIELDS = ("router_bias", "expert_bias", "swiglu_alpha", "swiglu_limit", "scoring", "n_group", "topk_group",
                    "routed_scaling_factor", "score_correction_bias", "shared_expert_gate", "router_scales",
                    "beside_dense")


def load_hf_config(path: str | Path) -> PretrainedConfig:
    """Read `config.json` from a local folder with transformers (no network).

    Guarded: whatever transformers raises for a config it cannot build (an unknown `model_type`, a field the
    named model type's config class does not take, as a relabelled `model_type` gives: "property 'head_dim'
    of 'FalconConfig' object has no setter") becomes one line naming the file and, where it can be told, the
    field."""
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise UnsupportedConfigError(f"{path}: no config.json found")
    quiet = logging.getLogger("transformers.configuration_utils")  # it logs the whole config before raising
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any config transformers cannot build is the user's file, named
        raise UnsupportedConfigError(_config_error_line(file, e)) from e
    finally:
        quiet.setLevel(level)


def _config_error_line(file: Path, error: Exception) -> str:
    """One line for transformers' `error` on `file`: the field its message names (a key of the file, quoted
    as transformers quotes names), or `model_type` when the message is about that type."""
    message = " ".join(str(error).split())
    try:
        fields = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        return f"{file}: not readable JSON ({' '.join(str(e).split())[:160]})"
    if not isinstance(fields, dict):
        return f"{file}: expected a JSON object, got {type(fields).__name__}"
    declared = fields.get("model_type")  # named in the message when transformers refused the type itself
    quoted = re.findall(r"['`\"]([A-Za-z_][\w.]*)['`\"]", message)
    named = next((q for q in quoted if q in fields and q != "model_type"), None)
    first = message.split(". ")[0][:200]
    if named is not None:
        return (f"{file} field {named}: does not fit model_type {declared!r} ({type(error).__name__}: {first}); "
                "is model_type right for this file?")
    if isinstance(declared, str) and declared in quoted:
        return f"{file} field model_type: {declared!r} is not a model type this transformers knows ({first})"
    return f"{file}: transformers cannot build a config from it ({type(error).__name__}: {first})"


def require(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise UnsupportedConfigError(f"config.json field {where}: {msg}")


def rope_check(hf: PretrainedConfig, *, partial: bool = False) -> float:
    """Refuse a RoPE hfmeg does not compute; returns `partial_rotary_factor`, which only a family that
    switches partial rotary on (`partial`) may set below 1."""
    params = getattr(hf, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    require(
        rope_type in SUPPORTED_ROPE_TYPES,
        "rope_parameters.rope_type",
        f"{rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})",
    )
    factor = params.get("partial_rotary_factor", 1.0)
    require(factor == 1.0 or partial, "partial_rotary_factor",
            f"partial rotary embeddings are not supported for {hf.model_type}")
    return factor


def check_tp(cfg: ModelConfig, tp: int, *, sequence_parallel: bool = False) -> None:
    """Raise if `cfg` cannot be split `tp` ways (heads, KV heads, FFN)."""
    require(cfg.num_heads % tp == 0, "num_attention_heads", f"{cfg.num_heads} is not divisible by TP={tp}")
    kv_fields = [(cfg.num_kv_heads, "num_key_value_heads")]
    if cfg.global_attention is not None:  # Gemma 4's full-attention layers: their own (fewer) KV heads
        kv_fields.append((cfg.global_attention.num_kv_heads, "num_global_key_value_heads"))
    for kv, name in kv_fields:
        require(kv % tp == 0 or tp % kv == 0, name,
                f"{kv} is not divisible by TP={tp}, nor TP by it (fewer KV heads than TP ranks are replicated, "
                "which needs TP to be a multiple of them)")
        require(kv % tp == 0 or not cfg.qk_norm_whole, name,
                f"{kv} is fewer than TP={tp}: replicated KV heads with a key norm over all of a token's heads "
                "(OLMo 2's qk norm) are not supported")
    if cfg.linear_attention is not None:  # each TP rank holds whole key heads and the value heads they serve
        require(cfg.linear_attention.key_heads % tp == 0, "linear_num_key_heads",
                f"{cfg.linear_attention.key_heads} is not divisible by TP={tp}")
    beside = cfg.moe is not None and cfg.moe.beside_dense  # Gemma 4: a dense MLP in every layer
    if beside or any(not cfg.is_sparse(i) for i in range(cfg.num_layers)):  # experts are not TP-split (models/moe.py)
        require(cfg.ffn_size % tp == 0, "intermediate_size", f"{cfg.ffn_size} is not divisible by TP={tp}")


def check_cp(cfg: ModelConfig, cp: int) -> None:
    """Raise if `cfg` has a feature context parallelism (parallel/context.py) would compute differently.

    LongRoPE switches to its long factors when a row's highest position passes the original context; a CP
    rank holds only its part of the row's positions, so ranks could pick different factors. The router's
    load-balancing loss is a product of means over a forward's tokens; a CP rank sees only its share of them,
    so its loss would not be the model's."""
    rope_type = (getattr(cfg.hf_config, "rope_parameters", None) or {}).get("rope_type")
    require(cp == 1 or rope_type != "longrope", "rope_parameters.rope_type",
            f"'longrope' picks its factors by the row's highest position, which a CP rank does not see whole; "
            f"not supported with parallel.cp={cp} (use cp 1)")
    require(cp == 1 or cfg.linear_attention is None, "layer_types",
            f"linear_attention layers carry a recurrent state along the row, which is not passed between CP ranks; "
            f"not supported with parallel.cp={cp} (use cp 1)")
    if cp > 1 and cfg.moe is not None:
        require(not cfg.moe.output_router_logits, "output_router_logits",
                 f"the router's load-balancing loss is not supported with parallel.cp={cp} (each CP rank routes only "
                 "its part of the sequence); set it false or use cp 1")


def check_ep(cfg: ModelConfig, ep: int) -> None:
    """Raise if `cfg`'s routed experts cannot be spread evenly over `ep` expert-parallel ranks."""
    if cfg.moe is None and ep > 1:
        raise UnsupportedConfigError(f"parallel.ep: {ep}, but a {cfg.model_type} model has no experts to spread; "
                                     "use ep 1")
    if cfg.moe is not None:
        n = cfg.moe.num_experts
        require(n % ep == 0, cfg.moe.experts_field,
                 f"{n} experts cannot be split evenly over parallel.ep={ep} (EP must divide the expert count)")
