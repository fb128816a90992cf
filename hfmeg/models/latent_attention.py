"""DeepSeek's multi-head latent attention (MLA, `ModelConfig.mla`), split over TP by heads.

As transformers' DeepseekV3Attention computes it, per token x:
- queries: `q_b(q_a_norm(q_a(x)))` (or one `q(x)` without a query latent), each head `[nope; rope]` wide;
- keys and values: `kv_a(x)` = `[latent; k_rot]`; `kv_b(kv_a_norm(latent))` gives each head's `[k_nope; v]`;
  `k_rot` is one rotated part every head shares;
- RoPE rotates the queries' rope part and `k_rot` (de-interleaved first where `rope_interleave`), and each head
  attends with q = `[q_nope; q_rot]`, k = `[k_nope; k_rot]` at `softmax_scale`, over values `v_head_dim` wide.

TP: the a-projections and their norms are whole on every rank and run on the tokens the rank holds (its sequence
shard under SP, every token otherwise); `q_b`, `kv_b` are column-parallel by heads and gather (SP) or copy their
latent input, `out` is row-parallel. So under SP the collective before attention moves the latents, not the hidden
state, and the a-projections see a rank's tokens only: their gradients are partial, summed over TP like a
sequence-parallel norm's (their role's `sequence_parallel` is the layout's). `k_rot` is gathered or copied beside
the kv latent. Under context parallelism keys and values are padded to one width for the one stacked all-gather of
K and V and cut back after it; SDPA and flex attend with values narrower than the keys as they are.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import ModelConfig
from ..parallel.comm import copy_to_tp, gather_from_sequence
from ..parallel.context import gather_kv
from ..parallel.layers import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from ..parallel.roles import ParamRole
from ..parallel.state import ParallelState
from .document_attention import DocumentMask, attend, layer_mask
from .kernels import Kernels
from .norm import RMSNorm

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with the default eps, not rms_norm_eps


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """`[x0, x1, x2, x3, ...]` -> `[x0, x2, ...; x1, x3, ...]`: rotate-half RoPE on the result is transformers'
    interleaved RoPE (`apply_rotary_pos_emb_interleave`), to the bit."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, layer: int, kernels: Kernels):
        super().__init__()
        m = self.mla = cfg.mla
        self.ps, self.kernels = ps, kernels
        self.heads = cfg.num_heads // ps.tp
        self.scale = cfg.attn_scale(layer)
        h, heads, sp = cfg.hidden_size, cfg.num_heads, ps.sequence_parallel
        latent_cfg = replace(cfg, norm_eps=LATENT_NORM_EPS)
        role = ParamRole("weight", sequence_parallel=sp)
        if m.q_lora_rank is None:
            self.q = ColumnParallelLinear(h, heads * cfg.head_dim, ps, bias=False)
        else:
            self.q_a = ReplicatedLinear(h, m.q_lora_rank, role)
            self.q_a_norm = RMSNorm(m.q_lora_rank, latent_cfg, sp, kernels)
            self.q_b = ColumnParallelLinear(m.q_lora_rank, heads * cfg.head_dim, ps, bias=False)
        self.kv_a = ReplicatedLinear(h, m.kv_lora_rank + m.qk_rope_head_dim, role)
        self.kv_a_norm = RMSNorm(m.kv_lora_rank, latent_cfg, sp, kernels)
        self.kv_b = ColumnParallelLinear(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), ps, bias=False)
        self.out = RowParallelLinear(heads * m.v_head_dim, h, ps, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, docs: DocumentMask | None,
                recompute_core: bool = False):
        m, ps = self.mla, self.ps
        q = self.q(x) if m.q_lora_rank is None else self.q_b(self.q_a_norm(self.q_a(x)))  # [s, b, heads * qk]
        latent, k_rot = self.kv_a(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = self.kv_b(self.kv_a_norm(latent))  # [s, b, heads * (nope + v)]
        k_rot = gather_from_sequence(k_rot, ps) if ps.sequence_parallel else copy_to_tp(k_rot, ps)
        docs = layer_mask(docs, None, q.shape[0] * ps.cp)
        if recompute_core:
            o = checkpoint(self._core, q, kv, k_rot, rope, docs, use_reentrant=False)
        else:
            o = self._core(q, kv, k_rot, rope, docs)
        return self.out(o)

    def _core(self, q: torch.Tensor, kv: torch.Tensor, k_rot: torch.Tensor, rope, docs: DocumentMask | None):
        m = self.mla
        s, b = q.shape[:2]
        nope, r, dv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        q_pass, q_rot = q.view(s, b, self.heads, nope + r).permute(1, 2, 0, 3).split([nope, r], dim=-1)
        k_pass, v = kv.view(s, b, self.heads, nope + dv).permute(1, 2, 0, 3).split([nope, dv], dim=-1)
        k_rot = k_rot.view(s, b, 1, r).permute(1, 2, 0, 3)  # [b, 1, s, r]: one rotated key for all heads
        if m.rope_interleave:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        if rope is not None:
            q_rot, k_rot = self.kernels.rope(q_rot, *rope), self.kernels.rope(k_rot, *rope)
        q = torch.cat((q_pass, q_rot), dim=-1)
        k = torch.cat((k_pass, k_rot.expand(-1, self.heads, -1, -1)), dim=-1)
        if self.ps.cp > 1:  # one stacked all-gather needs K and V of one width
            dk = k.shape[-1]
            w = max(dk, dv)
            k, v = gather_kv(F.pad(k, (0, w - dk)), F.pad(v, (0, w - dv)), self.ps)
            k, v = k[..., :dk], v[..., :dv]
        o = attend(q, k, v, docs, self.scale, gqa=False)
        return o.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, heads_local * v]
