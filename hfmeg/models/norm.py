"""RMSNorm (LLaMA family) and LayerNorm (GPT-2), replicated across TP ranks.

Under sequence parallelism a norm sees only its rank's slice of the sequence, so
its parameters carry `sequence_parallel = True` and their gradients are summed over
TP once per step (`hfmeg.parallel.comm.sync_sequence_parallel_grads`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .kernels import Kernels


def _mark(p: nn.Parameter, sequence_parallel: bool) -> nn.Parameter:
    if sequence_parallel:
        p.sequence_parallel = True
    return p


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, sequence_parallel: bool, kernels: Kernels):
        super().__init__()
        self.eps, self.kernels = eps, kernels
        self.weight = _mark(nn.Parameter(torch.empty(hidden)), sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, sequence_parallel: bool):
        super().__init__()
        self.eps = eps
        self.weight = _mark(nn.Parameter(torch.empty(hidden)), sequence_parallel)
        self.bias = _mark(nn.Parameter(torch.empty(hidden)), sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def make_norm(cfg: ModelConfig, sequence_parallel: bool, kernels: Kernels) -> nn.Module:
    if cfg.norm == "rms":
        return RMSNorm(cfg.hidden_size, cfg.norm_eps, sequence_parallel, kernels)
    return LayerNorm(cfg.hidden_size, cfg.norm_eps, sequence_parallel)
