"""Tensor-parallel layers: column/row-parallel and replicated linears, the vocab-parallel embedding and LM head.

The LM head's vocab-parallel loss is in `linear_cross_entropy.py`.

Weights hold only this rank's slice and are loaded from checkpoints (see
`hfmeg.checkpoint.rules`); the layers never initialise values themselves. Each
layer declares its parameters' roles (`roles.py`): which dim is split over TP, and
which replicated ones see only a sequence shard under SP.

Sequence parallelism changes only where the TP collectives sit: a column-parallel
layer all-gathers its input along the sequence instead of copying it, and a
row-parallel layer reduce-scatters its output along the sequence instead of
all-reducing it. Between those two points activations are `[seq/tp, batch, hidden]`.

Column- and row-parallel layers take an optional `adapter` (a LoRA/DoRA update,
`hfmeg/peft`): `adapter(x, y, weight)` is given the input exactly as this rank's matmul
sees it (after the column layer's gather/copy; the row layer's input shard), that
matmul's output `y = x W^T` without bias and this rank's weight, and returns what is
added to `y` before any reduction and before the bias, so base and adapter share the
one collective. `ReplicatedLinear` (the MoE router) takes one the same way; it has no
collective.

Column-, row-parallel and replicated linears run their GEMMs in FP8 where `fp8` is set (`model.fp8`: an
`Fp8Gemms`, set by `models/fp8.py`, which knows which of the layer's operands are split over TP).

The three linears also take an optional `weight_provider`: a module whose `()` gives the weight
their matmul uses in place of the `weight` parameter (a frozen base stored another way: QLoRA's 4-bit codes,
`quant/qlora.py`, installed by `checkpoint/load.py`, which then drops the parameter). `matmul_weight()` is that
weight, and the matmul is the provider's `linear(x, weight, bias)` (a 4-bit base's does not keep the dequantized
weight for backward: it dequantizes again there). The forward holds a provider's whole weight only where its adapter
reads it (`adapter.reads_weight`: DoRA); else the adapter is given None and the provider's matmul dequantizes the
weight a piece at a time. The two do not combine (a 4-bit base with `model.fp8` is refused by the run's checks).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from .comm import (
    copy_to_tp,
    gather_from_sequence,
    reduce_from_tp,
    reduce_scatter_to_sequence,
)
from .linear_cross_entropy import CE_CHUNK_TOKENS, linear_cross_entropy
from .roles import ParamRole, add_param
from .state import ParallelState
from .wgrad import embedding, linear

if TYPE_CHECKING:  # torchao is imported only by a run that asks for FP8 (`model.fp8`)
    from ..quant.fp8_training import Fp8Gemms


class _ProvidedWeight:
    """`matmul_weight()`: the `weight_provider`'s weight where the layer has one, else its `weight` parameter
    (`matmul_shape()`: its shape); `_forward_weight()`: what the forward holds of it (module docstring);
    `_linear(x, weight, bias)`: the matmul with it (in FP8 where `fp8` is set; the provider's own, which need not
    keep `weight` for backward, nor be given it)."""

    def matmul_weight(self) -> torch.Tensor:
        return self.weight if self.weight_provider is None else self.weight_provider()

    def _forward_weight(self) -> torch.Tensor | None:
        if self.weight_provider is None:
            return self.weight
        return self.weight_provider() if self.adapter is not None and self.adapter.reads_weight else None

    def matmul_shape(self) -> torch.Size:
        """`matmul_weight()`'s shape, without dequantizing a provider's weight to learn it."""
        return self.weight.shape if self.weight_provider is None else self.weight_provider.shape

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.weight_provider is None:
            return linear(x, weight, bias, self.fp8)
        return self.weight_provider.linear(x, weight, bias)


class ColumnParallelLinear(_ProvidedWeight, nn.Module):
    """y = x A^T + b with A split by rows (output features) across TP ranks.

    Input: the full activation (`[s, b, in]`, or `[s/tp, b, in]` under SP).
    Output: this rank's output features, `[s, b, out/tp]`.
    `shared_rows`/`shared_by`: the last `shared_rows` of a rank's rows are a copy held by `shared_by`
    consecutive ranks (replicated KV heads, `models/attention.py`; `out_features` counts them per rank).
    """

    def __init__(self, in_features: int, out_features: int, ps: ParallelState, bias: bool,
                 shared_rows: int = 0, shared_by: int = 1):
        super().__init__()
        if out_features % ps.tp:
            raise ValueError(f"output features {out_features} not divisible by TP={ps.tp}")
        self.ps = ps
        role = ParamRole("weight", tp_dim=0, shared_rows=shared_rows, shared_by=shared_by)
        add_param(self, "weight", out_features // ps.tp, in_features, role=role)
        if bias:
            add_param(self, "bias", out_features // ps.tp, role=replace(role, kind="bias"))
        else:
            self.bias = None
        self.adapter: nn.Module | None = None  # see the module docstring
        self.fp8: Fp8Gemms | None = None  # see the module docstring
        self.weight_provider: nn.Module | None = None  # see the module docstring

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_from_sequence(x, self.ps) if self.ps.sequence_parallel else copy_to_tp(x, self.ps)
        weight = self._forward_weight()
        if self.adapter is None:
            return self._linear(x, weight, self.bias)
        y = self._linear(x, weight)
        y = y + self.adapter(x, y, weight)
        return y if self.bias is None else y + self.bias


class RowParallelLinear(_ProvidedWeight, nn.Module):
    """y = x A^T + b with A split by columns (input features) across TP ranks.

    Input: this rank's features `[s, b, in/tp]`. Output: the summed full result,
    `[s, b, out]` (all-reduce) or `[s/tp, b, out]` (SP reduce-scatter). The bias is
    added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, ps: ParallelState, bias: bool):
        super().__init__()
        if in_features % ps.tp:
            raise ValueError(f"input features {in_features} not divisible by TP={ps.tp}")
        self.ps = ps
        add_param(self, "weight", out_features, in_features // ps.tp, role=ParamRole("weight", tp_dim=1))
        if bias:  # added after the reduction: replicated, and under SP applied to sequence shards
            add_param(self, "bias", out_features, role=ParamRole("bias", sequence_parallel=ps.sequence_parallel))
        else:
            self.bias = None
        self.adapter: nn.Module | None = None  # see the module docstring
        self.fp8: Fp8Gemms | None = None  # see the module docstring
        self.weight_provider: nn.Module | None = None  # see the module docstring

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._forward_weight()
        y = self._linear(x, weight)
        if self.adapter is not None:  # before the reduction: one collective sums both partial outputs
            y = y + self.adapter(x, y, weight)
        y = reduce_scatter_to_sequence(y, self.ps) if self.ps.sequence_parallel else reduce_from_tp(y, self.ps)
        return y + self.bias if self.bias is not None else y


class ReplicatedLinear(_ProvidedWeight, nn.Module):
    """y = x A^T with A whole on every TP rank and no collective (MoE routers and experts).

    The caller declares the weight's role: it depends on what the layer feeds it (a
    rank's own tokens give a partial gradient, `sequence_parallel`; an expert's weight
    is marked `expert`).
    """

    def __init__(self, in_features: int, out_features: int, role: ParamRole, bias: bool = False):
        super().__init__()
        if role.tp_dim is not None:
            raise ValueError("a replicated linear's weight is not TP-split")
        add_param(self, "weight", out_features, in_features, role=role)
        if bias:  # fed what the weight is fed: the same role, as a bias (gpt-oss's router)
            add_param(self, "bias", out_features, role=replace(role, kind="bias"))
        else:
            self.bias = None
        self.adapter: nn.Module | None = None  # see the module docstring (the MoE router's LoRA)
        self.fp8: Fp8Gemms | None = None  # see the module docstring
        self.weight_provider: nn.Module | None = None  # see the module docstring

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._forward_weight()
        y = self._linear(x, weight)
        y = y if self.adapter is None else y + self.adapter(x, y, weight)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the (padded) vocabulary split into contiguous TP ranges.

    Takes token ids `[b, s]`, returns `[s, b, h]` (or `[s/tp, b, h]` under SP): each
    rank looks up the ids in its range, zeros the rest, and the TP sum fills in all.
    Row `padding_idx` (a vocabulary id) gets no gradient, as in transformers' `nn.Embedding(padding_idx)`.
    """

    def __init__(self, padded_vocab: int, hidden: int, ps: ParallelState, tied: bool = False,
                 padding_idx: int | None = None):
        super().__init__()
        self.ps = ps
        self.per_rank = padded_vocab // ps.tp
        self.start = ps.tp_rank * self.per_rank
        inside = padding_idx is not None and self.start <= padding_idx < self.start + self.per_rank
        self.local_padding_idx = padding_idx - self.start if inside else None  # the row on this rank, if here
        # `tied`: the LM head of the last stage is a copy of this weight (summed over the embedding group).
        add_param(self, "weight", self.per_rank, hidden,
                  role=ParamRole("embedding", tp_dim=0, tied="embedding" if tied else None))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.t()  # [s, b]: sequence-first layout
        if self.ps.tp == 1:
            return embedding(ids, self.weight, self.local_padding_idx)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = embedding(local.masked_fill(outside, 0), self.weight, self.local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.ps.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.ps)
        return reduce_from_tp(out, self.ps)


def vocab_parallel_head(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None, ps: ParallelState,
                        vocab_size: int, chunk_tokens: int, softcap: float | None = None,
                        entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Project `x` `[s, b, h]` (`[s/tp, b, h]` under SP) on this rank's vocab rows `weight` `[V/tp, h]`.

    Without labels: this rank's logits `[b, s, V/tp]`. With labels `[b, s]`: the
    per-token loss `[b, s]`, from the chunked vocab-parallel cross-entropy that never
    materialises the full logits (linear_cross_entropy.py); with `entropy` also each token's softmax entropy
    `[b, s]` (no gradient), as `(loss, entropy)`. `softcap`: logits are `cap * tanh(logits / cap)`
    (Gemma's final soft-capping), in both.
    """
    x = gather_from_sequence(x, ps) if ps.sequence_parallel else copy_to_tp(x, ps)
    if labels is None:
        z = linear(x, weight).transpose(0, 1)
        return z if softcap is None else torch.tanh(z / softcap) * softcap
    out = linear_cross_entropy(x, weight, labels.t(), ps, vocab_size, chunk_tokens, softcap, entropy)
    return tuple(t.t() for t in out) if entropy else out.t()


class VocabParallelHead(nn.Module):
    """The LM head, its vocabulary rows split over TP like `VocabParallelEmbedding`'s.

    `tied_copy`: this is the last stage's copy of the first stage's tied embedding
    (its gradient is summed with the embedding's, see roles.py). A model whose one
    stage holds both ends of a tied model has no head module: it calls
    `vocab_parallel_head` with the embedding's weight.
    """

    def __init__(self, hidden: int, padded_vocab: int, vocab_size: int, ps: ParallelState, tied_copy: bool,
                 softcap: float | None = None):
        super().__init__()
        self.ps, self.vocab_size, self.softcap = ps, vocab_size, softcap
        add_param(self, "weight", padded_vocab // ps.tp, hidden, role=ParamRole(
            "embedding", tp_dim=0, tied="embedding" if tied_copy else None, tied_copy=tied_copy))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, chunk_tokens: int = CE_CHUNK_TOKENS,
                entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return vocab_parallel_head(x, self.weight, labels, self.ps, self.vocab_size, chunk_tokens, self.softcap,
                                   entropy)
