"""Tensor-parallel layers and the vocab-parallel cross-entropy.

Weights hold only this rank's slice and are loaded from checkpoints (see
`hfmeg.checkpoint.rules`); the layers never initialise values themselves.

Sequence parallelism changes only where the TP collectives sit: a column-parallel
layer all-gathers its input along the sequence instead of copying it, and a
row-parallel layer reduce-scatters its output along the sequence instead of
all-reducing it. Between those two points activations are `[seq/tp, batch, hidden]`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .comm import (
    copy_to_tp,
    gather_from_sequence,
    reduce_from_tp,
    reduce_scatter_to_sequence,
)
from .state import ParallelState


def _param(*shape: int, sequence_parallel: bool = False) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape))
    if sequence_parallel:
        p.sequence_parallel = True  # partial gradient per TP rank: see sync_sequence_parallel_grads
    return p


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split by rows (output features) across TP ranks.

    Input: the full activation (`[s, b, in]`, or `[s/tp, b, in]` under SP).
    Output: this rank's output features, `[s, b, out/tp]`.
    """

    def __init__(self, in_features: int, out_features: int, ps: ParallelState, bias: bool):
        super().__init__()
        if out_features % ps.tp:
            raise ValueError(f"output features {out_features} not divisible by TP={ps.tp}")
        self.ps = ps
        self.weight = _param(out_features // ps.tp, in_features)
        self.bias = _param(out_features // ps.tp) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_from_sequence(x, self.ps) if self.ps.sequence_parallel else copy_to_tp(x, self.ps)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
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
        self.weight = _param(out_features, in_features // ps.tp)
        self.bias = _param(out_features, sequence_parallel=ps.sequence_parallel) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        y = reduce_scatter_to_sequence(y, self.ps) if self.ps.sequence_parallel else reduce_from_tp(y, self.ps)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the (padded) vocabulary split into contiguous TP ranges.

    Takes token ids `[b, s]`, returns `[s, b, h]` (or `[s/tp, b, h]` under SP): each
    rank looks up the ids in its range, zeros the rest, and the TP sum fills in all.
    """

    def __init__(self, padded_vocab: int, hidden: int, ps: ParallelState):
        super().__init__()
        self.ps = ps
        self.per_rank = padded_vocab // ps.tp
        self.start = ps.tp_rank * self.per_rank
        self.weight = _param(self.per_rank, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.t()  # [s, b]: sequence-first layout
        if self.ps.tp == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.ps.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.ps)
        return reduce_from_tp(out, self.ps)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over vocab-sharded logits without gathering them.

    With logits z split over ranks, loss = log(sum_all exp(z - m)) - (z_t - m), where
    the max m, the exp-sum and the target logit z_t are each one TP all-reduce of a
    `[s, b]` tensor. Columns past the real vocabulary (padding) are masked to -inf so
    the loss equals the unpadded model's. The gradient is softmax - onehot(target).
    """

    @staticmethod
    def forward(ctx, logits, target, ps, vocab_start, vocab_size):
        z = logits.float()
        n_local = z.shape[-1]
        cols = torch.arange(vocab_start, vocab_start + n_local, device=z.device)
        if int(cols[-1]) >= vocab_size:
            z = z.masked_fill(cols >= vocab_size, float("-inf"))
        m = z.max(dim=-1).values
        if ps.tp > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.tp_group)
        z = z - m.unsqueeze(-1)
        local_t = target - vocab_start
        in_range = (local_t >= 0) & (local_t < n_local)
        local_t = local_t.masked_fill(~in_range, 0)
        z_t = torch.where(in_range, z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1), 0.0)
        exp = z.exp()
        sum_exp = exp.sum(dim=-1)
        if ps.tp > 1:
            both = torch.stack([z_t, sum_exp])
            dist.all_reduce(both, group=ps.tp_group)
            z_t, sum_exp = both[0], both[1]
        loss = sum_exp.log() - z_t
        exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(exp, local_t, in_range)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, local_t, in_range = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -in_range.to(grad.dtype).unsqueeze(-1))
        grad.mul_(g.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ps: ParallelState, vocab_size: int
) -> torch.Tensor:
    """Per-token loss `[...]` (fp32) from this rank's logits `[..., padded_vocab/tp]`.

    Targets equal to -100 get loss 0 (and no gradient).
    """
    vocab_start = ps.tp_rank * logits.shape[-1]
    ignore = target < 0
    loss = _VocabParallelCrossEntropy.apply(logits, target.masked_fill(ignore, 0), ps, vocab_start, vocab_size)
    return loss.masked_fill(ignore, 0.0)
