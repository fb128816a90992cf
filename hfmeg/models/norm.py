"""RMSNorm (LLaMA family) and LayerNorm (GPT-2), replicated across TP ranks.

Under sequence parallelism a norm sees only its rank's slice of the sequence, so its
parameters' role (`hfmeg.parallel.roles`) says `sequence_parallel` and their gradients
are summed over TP once per step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..parallel.comm import all_reduce_tp
from ..parallel.roles import ParamRole, add_param
from ..parallel.state import ParallelState
from .kernels import Kernels


def rms_kernel(cfg: ModelConfig, kernels: Kernels):
    """The family's RMSNorm: Gemma 2/3's scales by (1 + weight) (`ModelConfig.norm_offset`), Gemma 4's by the weight
    in fp32 (`norm_fp32_scale`), the others by the weight in the input dtype."""
    if cfg.norm_offset:
        return kernels.rms_norm_offset
    return kernels.rms_norm_fp32 if cfg.norm_fp32_scale else kernels.rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, cfg: ModelConfig, sequence_parallel: bool, kernels: Kernels):
        super().__init__()
        self.eps = cfg.norm_eps
        self.norm = rms_kernel(cfg, kernels)
        add_param(self, "weight", hidden, role=ParamRole("norm", sequence_parallel=sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight, self.eps)


class HeadsRMSNorm(nn.Module):
    """OLMo 2's q/k norm: one RMSNorm over all `heads` of a token (`ModelConfig.qk_norm_whole`), on `[b, heads_local,
    s, d]`. A TP rank holds a slice of the heads and the matching rows of the weight (`tp_dim=0`), so the sum of
    squares is all-reduced over TP before normalising. It runs after the QKV projection has gathered the sequence,
    so sequence parallelism does not enter."""

    def __init__(self, heads: int, head_dim: int, eps: float, ps: ParallelState):
        super().__init__()
        self.eps, self.ps, self.size = eps, ps, heads * head_dim
        add_param(self, "weight", heads // ps.tp * head_dim, role=ParamRole("norm", tp_dim=0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, s, d = x.shape
        x32 = x.float()
        sq = all_reduce_tp(x32.pow(2).sum(dim=(1, 3), keepdim=True), self.ps)  # [b, 1, s, 1]
        x32 = x32 * torch.rsqrt(sq / self.size + self.eps)
        return self.weight.view(n, 1, d) * x32.to(x.dtype)


class LayerNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, sequence_parallel: bool):
        super().__init__()
        self.eps = eps
        add_param(self, "weight", hidden, role=ParamRole("norm", sequence_parallel=sequence_parallel))
        add_param(self, "bias", hidden, role=ParamRole("norm_bias", sequence_parallel=sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def make_norm(cfg: ModelConfig, sequence_parallel: bool, kernels: Kernels) -> nn.Module:
    if cfg.norm == "rms":
        return RMSNorm(cfg.hidden_size, cfg, sequence_parallel, kernels)
    return LayerNorm(cfg.hidden_size, cfg.norm_eps, sequence_parallel)
