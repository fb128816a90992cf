"""Tensor-parallel self-attention with fused per-group QKV, GQA/MQA and SDPA.

The fused QKV weight is laid out per KV group, `[q heads of group g; k_g; v_g]`, and
split by whole groups across TP ranks, so each rank computes its heads with no
communication between the QKV projection and the output projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..errors import UnsupportedConfigError
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..parallel.state import ParallelState
from .kernels import Kernels


class ParallelAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, layer: int, kernels: Kernels):
        super().__init__()
        self.cfg, self.kernels = cfg, kernels
        self.groups = cfg.num_kv_heads // ps.tp  # KV groups on this rank
        self.rep = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head
        self.scale = cfg.attn_scale(layer)
        d = cfg.head_dim
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
        self.qkv = ColumnParallelLinear(cfg.hidden_size, qkv_out, ps, bias=cfg.qkv_bias)
        self.out = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, ps, bias=cfg.out_bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None):
        qkv = self.qkv(x)  # [s, b, groups * (rep + 2) * d]
        s, b = qkv.shape[:2]
        if self.cfg.sliding_window is not None and s > self.cfg.sliding_window:
            raise UnsupportedConfigError(
                f"config.json field sliding_window: sequence length {s} exceeds the sliding window "
                f"{self.cfg.sliding_window}; windowed attention is not supported"
            )
        d = self.cfg.head_dim
        qkv = qkv.view(s, b, self.groups, self.rep + 2, d).permute(1, 2, 3, 0, 4)  # [b, g, rep+2, s, d]
        q = qkv[:, :, : self.rep].reshape(b, self.groups * self.rep, s, d)
        k = qkv[:, :, self.rep]
        v = qkv[:, :, self.rep + 1]
        if rope is not None:
            q, k = self.kernels.rope(q, *rope), self.kernels.rope(k, *rope)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=self.rep > 1
        )
        o = o.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, heads_local * d]
        return self.out(o)


def document_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Boolean `[b, 1, s, s]` mask: causal, and no attention across packed documents."""
    s = segment_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (same & causal).unsqueeze(1)
