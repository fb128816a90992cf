"""Model FLOPs and MFU, with the Megatron-LM paper's accounting.

Narayanan et al. (2021) count, for a GPT with hidden h, l layers, sequence s,
vocabulary V and batch B, the FLOPs of one training iteration without activation
recomputation as

    F = 72 B s l h^2 (1 + s / (6h) + V / (12 l h))
      = 6 B s (12 l h^2)  +  12 B s^2 l h  +  6 B s h V

i.e. 6 FLOPs per token per matmul parameter (2 forward, 4 backward), plus the
attention score and value products (2 * 2 s h per token per layer, times 3), plus
the LM head. `training_flops` is that formula with the layer matmul parameters
counted exactly, so it also covers GQA (smaller K/V projections) and SwiGLU (three
FFN matrices), MoE layers (router, the top-k experts and the shared expert a token
goes through: its active parameters, not all experts; DeepSeek-V3's grouped choice among
the experts is elementwise work, not counted), and DeepSeek's latent attention (its
down- and up-projections, and score and value products of their own widths). Recomputation is not counted: MFU measures
useful model work.

A layer with a sliding window w computes fewer (query, key) pairs than the causal s(s+1)/2:
sum over positions of min(i + 1, w). Its attention term keeps Megatron's convention (s keys per
token for a causal layer) scaled by that ratio (`attended_keys`).

A Gated DeltaNet layer (Qwen3.5's linear attention) has no s^2 term: its projections count as matmul
parameters, and the chunked delta rule (`models/gated_delta_rule.py`, chunks of C tokens, C = min(64, s))
costs per token and value head, forward, 2 (2 C dk + C (dk + dv) / 2 + C dv + 3 dk dv) FLOPs: the chunk's
k k^T and q k^T products, its two triangular solves (half a C x C matrix per column), the scores times the
corrected values, and three products with the dk x dv state; times 3 for forward + backward, as the matmuls.
The depthwise convolution's 2 K FLOPs per channel and token are counted too.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..models.gated_delta_rule import CHUNK
from .hardware import GPUS, gpu_kind

def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of a known GPU kind (hardware.GPUS); None for other devices and CPUs."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    kind = gpu_kind(props.name, props.total_memory)
    return GPUS[kind].peak_flops if kind else None


def layer_matmul_params(cfg: ModelConfig, layer: int) -> int:
    """Matmul parameters one token goes through in `layer`: for an MoE layer the router, its top-k
    experts and the shared expert (the experts it is not routed to cost it nothing); Gemma 4's per-layer input
    (its gate, its projection, and its share of the first stage's projection)."""
    h = cfg.hidden_size
    if cfg.is_linear(layer):
        la = cfg.linear_attention
        qkv, out = h * sum(la.in_pieces()), la.value_heads * la.value_dim * h
    elif cfg.mla is not None:  # its projections: every attention parameter but the two latent norms'
        a = cfg.mla
        qkv, out = a.num_params(h, cfg.num_heads) - (a.q_lora_rank or 0) - a.kv_lora_rank, 0
    else:  # the layer's own shape (Gemma 4's full layers: wider heads, fewer KV heads, maybe no value projection)
        a = cfg.attention_shape(layer)
        qkv = h * (cfg.num_heads * cfg.q_rows_of(layer) + a.kv_parts * a.num_kv_heads * a.head_dim)
        out = cfg.num_heads * a.head_dim * h
    m = cfg.moe
    dense = (3 if cfg.gated_mlp else 2) * h * cfg.ffn_size_of(layer)
    per_layer = 3 * h * cfg.per_layer_input_size
    if cfg.is_sparse(layer):
        shared = 3 * h * m.shared_expert_ffn_size + h * m.shared_expert_gate if m.shared_expert_ffn_size else 0
        mlp = h * m.num_experts + m.top_k * 3 * h * m.expert_ffn_size + shared + (dense if m.beside_dense else 0)
    else:
        mlp = dense
    return qkv + out + mlp + per_layer


def attended_keys(cfg: ModelConfig, layer: int, seq_len: int) -> float:
    """Megatron's keys per token (`seq_len` for a causal layer), scaled for a windowed layer by its share of the
    causal (query, key) pairs."""
    w = cfg.window(layer)
    if w is None or w >= seq_len:
        return float(seq_len)
    pairs = w * (w + 1) / 2 + (seq_len - w) * w
    return seq_len * pairs / (seq_len * (seq_len + 1) / 2)


def delta_rule_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token of one Gated DeltaNet layer's convolution and chunked delta rule (module
    doc)."""
    la = cfg.linear_attention
    c, dk, dv = min(CHUNK, seq_len), la.key_dim, la.value_dim
    rule = 2 * (2 * c * dk + c * (dk + dv) / 2 + c * dv + 3 * dk * dv) * la.value_heads
    return 3 * (rule + 2 * la.conv_kernel * la.conv_channels)


def training_flops(cfg: ModelConfig, batch: int, seq_len: int) -> float:
    """FLOPs of one forward + backward over `batch` sequences of `seq_len` tokens."""
    tokens = batch * seq_len
    def widths(layer: int) -> int:
        """The score product's width and the value product's (MLA: values narrower than queries and keys)."""
        d = cfg.attention_shape(layer).head_dim
        return cfg.num_heads * d + cfg.num_heads * (cfg.mla.v_head_dim if cfg.mla is not None else d)

    layers = sum(layer_matmul_params(cfg, i) for i in range(cfg.num_layers))
    dense = 6 * tokens * (layers + cfg.hidden_size * cfg.vocab_size)
    attending = [i for i in range(cfg.num_layers) if not cfg.is_linear(i)]
    attention = 6 * tokens * sum(attended_keys(cfg, i, seq_len) * widths(i) for i in attending)
    linear = tokens * (cfg.num_layers - len(attending)) * delta_rule_flops(cfg, seq_len) if cfg.linear_attention else 0
    return float(dense + attention + linear)


def mfu(cfg: ModelConfig, tokens_per_s: float, seq_len: int, peak_flops_per_device: float, devices: int) -> float:
    """Model FLOPs utilisation of `devices` devices processing `tokens_per_s`."""
    flops_per_token = training_flops(cfg, 1, seq_len) / seq_len
    return tokens_per_s * flops_per_token / (peak_flops_per_device * devices)
