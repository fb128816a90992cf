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
from ..parallel.roles import ParamRole, add_param
from .kernels import Kernels


class RMSNorm(nn.Module):
    """`offset`: Gemma's norm, which scales by (1 + weight) (`ModelConfig.norm_offset`)."""

    def __init__(self, hidden: int, eps: float, sequence_parallel: bool, kernels: Kernels, offset: bool = False):
        super().__init__()
        self.eps = eps
        self.norm = kernels.rms_norm_offset if offset else kernels.rms_norm
        add_param(self, "weight", hidden, role=ParamRole("norm", sequence_parallel=sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight, self.eps)


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
        return RMSNorm(cfg.hidden_size, cfg.norm_eps, sequence_parallel, kernels, cfg.norm_offset)
    return LayerNorm(cfg.hidden_size, cfg.norm_eps, sequence_parallel)
