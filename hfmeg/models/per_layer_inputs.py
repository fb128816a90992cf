"""Gemma 4's per-layer input embeddings (the E2B and E4B: `ModelConfig.per_layer_input_size` = P), as transformers'
`Gemma4TextModel` computes them.

Every layer i gets a P-wide input per token, made once on the first stage from the token ids and the token
embedding x (already scaled by sqrt(hidden)):

    ((RMSNorm_P((x W^T) / sqrt(hidden))[i] + E[id][i] * sqrt(P)) / sqrt(2)

with E the per-layer embedding table `[vocab, L * P]` (all layers packed) and W `[L * P, hidden]`. Layer i adds,
after its MLP's residual add and before its `layer_scalar`, norm(Wp (gelu(Wg h) * input_i)) to the residual stream.

Placement. The table is split by vocabulary rows over TP like the token embedding (its lookup's TP sum is the
row); W, the norms and each layer's two small projections are whole on every TP rank (under sequence parallelism
each rank sees its tokens only, so their gradients are summed over TP: role `sequence_parallel`). The inputs of
all L layers travel with the hidden state between pipeline stages (`ModelConfig.stage_width`: hidden + L * P
features a token), so no later stage needs the tables; the gradients a stage's layers give their inputs flow back
the same way to the first stage's table and W.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..parallel.layers import VocabParallelEmbedding
from ..parallel.roles import ParamRole, add_param
from ..parallel.state import ParallelState
from .kernels import Kernels
from .norm import RMSNorm, make_norm


class ReplicatedLinear(nn.Module):
    """`x W^T` with W whole on every TP rank (summed over TP where each rank sees its own tokens)."""

    def __init__(self, inputs: int, outputs: int, sequence_parallel: bool):
        super().__init__()
        add_param(self, "weight", outputs, inputs, role=ParamRole("weight", sequence_parallel=sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class PerLayerInputs(nn.Module):
    """The first stage's tables: every layer's input `[s, b, L * P]` from the ids `[b, s]` and x `[s, b, h]`."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState, padded_vocab: int, kernels: Kernels):
        super().__init__()
        self.cfg = cfg
        width = cfg.num_layers * cfg.per_layer_input_size
        sp = ps.sequence_parallel
        self.embed = VocabParallelEmbedding(padded_vocab, width, ps, padding_idx=cfg.pad_token_id)
        self.projection = ReplicatedLinear(cfg.hidden_size, width, sp)
        self.norm = RMSNorm(cfg.per_layer_input_size, cfg, sp, kernels)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        p = self.cfg.per_layer_input_size
        per_layer = (*x.shape[:2], self.cfg.num_layers, p)
        token = self.embed(ids)  # sequence-scattered under SP, as x is
        token = token * torch.tensor(p ** 0.5, dtype=token.dtype)  # the scale rounded to the table's dtype
        context = self.norm((self.projection(x) * self.cfg.hidden_size ** -0.5).view(per_layer))
        return ((context + token.view(per_layer)) * 2 ** -0.5).flatten(2)


class PerLayerInput(nn.Module):
    """One layer's use of its input: `x + norm(projection(act(gate(x)) * input))`, act the MLP's."""

    def __init__(self, cfg: ModelConfig, sequence_parallel: bool, kernels: Kernels):
        super().__init__()
        h, p = cfg.hidden_size, cfg.per_layer_input_size
        self.gate = ReplicatedLinear(h, p, sequence_parallel)
        self.projection = ReplicatedLinear(p, h, sequence_parallel)
        self.norm = make_norm(cfg, sequence_parallel, kernels)
        self.act = F.silu if cfg.activation == "silu" else partial(F.gelu, approximate="tanh")  # the MLP's

    def forward(self, x: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.projection(self.act(self.gate(x)) * inputs))
