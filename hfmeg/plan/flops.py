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
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
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
    experts and the shared expert (the experts it is not routed to cost it nothing)."""
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    out = cfg.num_heads * d * h
    if cfg.mla is not None:  # its projections: every attention parameter but the two latent norms'
        a = cfg.mla
        qkv = a.num_params(h, cfg.num_heads) - (a.q_lora_rank or 0) - a.kv_lora_rank
        out = 0
    m = cfg.moe
    if cfg.is_sparse(layer):
        shared = 3 * h * m.shared_expert_ffn_size + h * m.shared_expert_gate if m.shared_expert_ffn_size else 0
        mlp = h * m.num_experts + m.top_k * 3 * h * m.expert_ffn_size + shared
    else:
        mlp = (3 if cfg.gated_mlp else 2) * h * cfg.ffn_size
    return qkv + out + mlp


def attended_keys(cfg: ModelConfig, layer: int, seq_len: int) -> float:
    """Megatron's keys per token (`seq_len` for a causal layer), scaled for a windowed layer by its share of the
    causal (query, key) pairs."""
    w = cfg.window(layer)
    if w is None or w >= seq_len:
        return float(seq_len)
    pairs = w * (w + 1) / 2 + (seq_len - w) * w
    return seq_len * pairs / (seq_len * (seq_len + 1) / 2)


def training_flops(cfg: ModelConfig, batch: int, seq_len: int) -> float:
    """FLOPs of one forward + backward over `batch` sequences of `seq_len` tokens."""
    tokens = batch * seq_len
    # the score product's width and the value product's (MLA: values narrower than queries and keys)
    value_width = cfg.num_heads * (cfg.mla.v_head_dim if cfg.mla is not None else cfg.head_dim)
    widths = cfg.num_heads * cfg.head_dim + value_width
    layers = sum(layer_matmul_params(cfg, i) for i in range(cfg.num_layers))
    dense = 6 * tokens * (layers + cfg.hidden_size * cfg.vocab_size)
    keys = sum(attended_keys(cfg, i, seq_len) for i in range(cfg.num_layers))
    attention = 6 * tokens * keys * widths
    return float(dense + attention)


def mfu(cfg: ModelConfig, tokens_per_s: float, seq_len: int, peak_flops_per_device: float, devices: int) -> float:
    """Model FLOPs utilisation of `devices` devices processing `tokens_per_s`."""
    flops_per_token = training_flops(cfg, 1, seq_len) / seq_len
    return tokens_per_s * flops_per_token / (peak_flops_per_device * devices)
