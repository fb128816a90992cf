"""Tensor-parallel MLP: SwiGLU (LLaMA family) or GeGLU (Gemma) with fused gate/up, or GELU (GPT-2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..parallel.state import ParallelState
from .kernels import Kernels


class ParallelMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, kernels: Kernels, ffn: int | None = None):
        super().__init__()
        self.cfg, self.kernels = cfg, kernels
        self.glu = kernels.swiglu if cfg.activation == "silu" else kernels.geglu
        ffn = ffn or cfg.ffn_size  # a layer's own width (Gemma 4's double-wide MLPs: `ModelConfig.ffn_size_of`)
        fc1_out = 2 * ffn if cfg.gated_mlp else ffn
        # With gate/up fused, each rank's fc1 slice is [gate_r; up_r] (see checkpoint.rules).
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, fc1_out, ps, bias=cfg.mlp_bias)
        self.fc2 = RowParallelLinear(ffn, cfg.hidden_size, ps, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.cfg.gated_mlp:
            gate, up = h.chunk(2, dim=-1)
            h = self.glu(gate, up)
        else:
            h = F.gelu(h, approximate="tanh" if self.cfg.activation == "gelu_tanh" else "none")
        return self.fc2(h)
