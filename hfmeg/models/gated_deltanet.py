"""Tensor-parallel Gated DeltaNet, the linear-attention layer of Qwen3.5 (`ModelConfig.linear_attention`).

One column-parallel projection makes, per TP rank, `[q; k; v; z; b; a]` for this rank's heads (HF's
`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, each split by heads: `checkpoint/rules.py` kind `parts`);
q, k and v go through a short depthwise causal convolution and SiLU, q and k are L2-normalised (q also scaled
by key_dim^-0.5), beta = sigmoid(b) and the log-decay g = -exp(A_log) * softplus(a + dt_bias); the gated delta
rule (`gated_delta_rule.py`) mixes the tokens; each value head's output is RMS-normalised (one weight for all
heads), scaled by SiLU(z) and projected back by the row-parallel `out`. A rank holds whole key heads and the
value heads they serve (value head j reads key head j // (value_heads / key_heads)), so nothing crosses ranks
between the two projections; the convolution's channels, A_log and dt_bias are split with their heads. The
gated norm's weight is shared by all heads: TP-replicated, each rank's gradient from its own heads, summed over
TP (`sequence_parallel` role), as the q/k norms of attention.

Packed rows: the convolution window and the recurrent state restart at each document (`DocumentMask.documents`,
from the row's segment ids), so a packed row computes what each document alone computes. The layer takes the
attention's arguments (RoPE tables, unused: it has no positions) so the decoder layer calls either alike.
Context parallelism is refused for these models (`config.check_cp`): the state is not passed between CP ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import ModelConfig
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..parallel.roles import ParamRole, add_param
from ..parallel.state import ParallelState
from .document_attention import DocumentMask
from .gated_delta_rule import causal_conv, chunk_gated_delta_rule


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of `x` over its last dim, scaled by `weight` in the input dtype, times SiLU(gate) in fp32, rounded
    once (transformers' Qwen3_5RMSNormGated)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (the flash-linear-attention form transformers uses)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState):
        super().__init__()
        la = cfg.linear_attention
        tp = ps.tp
        self.eps = cfg.norm_eps
        self.key_heads, self.value_heads = la.key_heads // tp, la.value_heads // tp
        self.key_dim, self.value_dim = la.key_dim, la.value_dim
        self.pieces = [p // tp for p in la.in_pieces()]
        self.in_proj = ColumnParallelLinear(cfg.hidden_size, sum(la.in_pieces()), ps, bias=False)
        add_param(self, "conv_weight", la.conv_channels // tp, 1, la.conv_kernel, role=ParamRole("weight", tp_dim=0))
        # Per-head scalars of the decay, kept out of weight decay as biases are (kind "bias").
        add_param(self, "A_log", self.value_heads, role=ParamRole("bias", tp_dim=0))
        add_param(self, "dt_bias", self.value_heads, role=ParamRole("bias", tp_dim=0))
        add_param(self, "norm_weight", la.value_dim, role=ParamRole("norm", sequence_parallel=True))
        self.out = RowParallelLinear(la.value_heads * la.value_dim, cfg.hidden_size, ps, bias=False)

    def forward(self, x: torch.Tensor, rope, docs: DocumentMask | None, recompute_core: bool = False) -> torch.Tensor:
        y = self.in_proj(x)  # [s, b, this rank's q, k, v, z, b, a]
        documents = docs.documents if docs is not None else None
        if recompute_core:
            o = checkpoint(self._core, y, documents, use_reentrant=False)
        else:
            o = self._core(y, documents)
        return self.out(o)

    def _core(self, y: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
        s, b = y.shape[:2]
        kh, vh, dk, dv = self.key_heads, self.value_heads, self.key_dim, self.value_dim
        y = y.transpose(0, 1)  # [b, s, ...]
        qkv, z, beta, a = y.split([sum(self.pieces[:3]), *self.pieces[3:]], dim=-1)
        qkv = causal_conv(qkv, self.conv_weight.squeeze(1), documents)
        q, k, v = qkv.split(self.pieces[:3], dim=-1)

        def heads(t: torch.Tensor, n: int) -> torch.Tensor:  # [b, s, n * d] -> [b, n, s, d] in fp32
            return t.reshape(b, s, n, -1).transpose(1, 2).float()
        q, k = l2_norm(heads(q, kh)), l2_norm(heads(k, kh))
        q, k = (t.repeat_interleave(vh // kh, dim=1) for t in (q, k))  # value head j reads key head j // rep
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        o = chunk_gated_delta_rule(q * dk ** -0.5, k, heads(v, vh), g.transpose(1, 2), beta.sigmoid().float()
                                   .transpose(1, 2), documents)
        o = o.transpose(1, 2).to(y.dtype)  # [b, s, vh, dv]
        o = gated_rms_norm(o, self.norm_weight, z.reshape(b, s, vh, dv), self.eps)
        return o.reshape(b, s, vh * dv).transpose(0, 1)  # [s, b, vh * dv]
