"""Autograd-aware tensor-parallel collectives.

Each function is a pair of conjugate operations: what the forward does on the TP
group, the backward does the transpose of. Activations are laid out
`[seq, batch, hidden]` so that sequence-parallel shards are contiguous slices of
dim 0, which is what the flat all-gather / reduce-scatter collectives produce.

| function                  | forward                     | backward                    |
|---------------------------|-----------------------------|-----------------------------|
| copy_to_tp                | identity                    | all-reduce                  |
| reduce_from_tp            | all-reduce                  | identity                    |
| all_reduce_tp             | all-reduce                  | all-reduce                  |
| all_reduce_cp             | all-reduce over CP          | all-reduce over CP          |
| scatter_to_sequence       | keep own seq slice          | all-gather along seq        |
| gather_from_sequence      | all-gather along seq        | reduce-scatter along seq    |
| reduce_scatter_to_sequence| reduce-scatter along seq    | all-gather along seq        |
| gather_last_dim           | all-gather along last dim   | keep own slice              |
| split_tokens              | keep own block of rows      | all-gather the blocks       |
| gather_tokens             | all-gather the blocks       | keep own block of rows      |

`split_tokens` / `gather_tokens` cut a replicated `[n, ...]` tensor into TP blocks of
ceil(n/tp) rows (the last ones shorter or empty), so any n works: the MoE layer uses
them to route each rank's share of the tokens when activations are not sequence-parallel.
Unlike `gather_from_sequence`, `gather_tokens`'s backward keeps its own block instead of
reduce-scattering, because its output feeds replicated computation whose gradient is
already whole on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .roles import named_roles
from .state import ParallelState

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# The helpers below run only for TP > 1 (the public functions are identities at TP = 1).
def _all_reduce(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=ps.tp_group)
    return x


def _gather_dim0(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * ps.tp,) + tuple(x.shape[1:]))
    all_gather_flat(out, x, group=ps.tp_group)
    return out


def _shard_len(x: torch.Tensor, ps: ParallelState) -> int:
    if x.shape[0] % ps.tp:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by TP={ps.tp}")
    return x.shape[0] // ps.tp


def _reduce_scatter_dim0(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    out = x.new_empty((_shard_len(x, ps),) + tuple(x.shape[1:]))
    reduce_scatter_flat(out, x.contiguous(), group=ps.tp_group)
    return out


def _split_dim0(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    n = _shard_len(x, ps)
    return x[ps.tp_rank * n : (ps.tp_rank + 1) * n].contiguous()


def _gather_last(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    return _gather_dim0(x.movedim(-1, 0), ps).movedim(0, -1).contiguous()


def _split_last(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    n = x.shape[-1] // ps.tp
    return x[..., ps.tp_rank * n : (ps.tp_rank + 1) * n].contiguous()


def conjugate_pair(name: str, forward_op, backward_op, size=lambda ps: ps.tp):
    """A collective autograd function: `forward_op` on the way in, `backward_op` on the way back;
    the identity where its group (TP, unless `size` names another) has one rank."""

    def forward(ctx, x, ps):
        ctx.ps = ps
        return forward_op(x, ps)

    def backward(ctx, g):
        return backward_op(g, ctx.ps), None

    fn = type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})

    def apply(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
        return fn.apply(x, ps) if size(ps) > 1 else x

    return apply


def _identity(x, ps):
    return x


# The all-reduce in reduce_from_tp works in place, so it runs on a copy of the input.
copy_to_tp = conjugate_pair("CopyToTP", _identity, _all_reduce)
reduce_from_tp = conjugate_pair("ReduceFromTP", lambda x, ps: _all_reduce(x.clone(), ps), _identity)
# A sum every rank goes on to use with its own shard (OLMo 2's q/k norm statistics): each rank's gradient of it
# is a part, so the backward sums them too.
all_reduce_tp = conjugate_pair("AllReduceTP", lambda x, ps: _all_reduce(x.clone(), ps),
                               lambda g, ps: _all_reduce(g.clone(), ps))

def _all_reduce_cp(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x, group=ps.cp_group)
    return x


# Per-sequence sums over the tokens the CP ranks hold (DPO's log-probabilities, train/preference.py): each CP rank
# adds its tokens' parts, and a loss that every CP rank computes from the sums, divided by CP, has each rank's part
# of the sums' gradient summed back.
all_reduce_cp = conjugate_pair("AllReduceCP", _all_reduce_cp, _all_reduce_cp, size=lambda ps: ps.cp)
scatter_to_sequence = conjugate_pair("ScatterToSequence", _split_dim0, _gather_dim0)
gather_from_sequence = conjugate_pair("GatherFromSequence", _gather_dim0, _reduce_scatter_dim0)
reduce_scatter_to_sequence = conjugate_pair("ReduceScatterToSequence", _reduce_scatter_dim0, _gather_dim0)
gather_last_dim = conjugate_pair("GatherLastDim", _gather_last, _split_last)


def _token_block(n: int, ps: ParallelState) -> tuple[int, int]:
    per = -(-n // ps.tp)
    lo = min(ps.tp_rank * per, n)
    return lo, min(lo + per, n)


def _gather_token_blocks(x: torch.Tensor, ps: ParallelState, n: int) -> torch.Tensor:
    # Blocks are contiguous and only the tail ones are short, so the padded blocks
    # gathered in rank order, cut to n rows, are the rows in their original order.
    per = -(-n // ps.tp)
    padded = x.new_zeros((per,) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    return _gather_dim0(padded, ps)[:n]


class _SplitTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ps):
        ctx.ps, ctx.n = ps, x.shape[0]
        lo, hi = _token_block(x.shape[0], ps)
        return x[lo:hi].contiguous()

    @staticmethod
    def backward(ctx, g):
        return _gather_token_blocks(g, ctx.ps, ctx.n), None


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ps, n):
        ctx.ps, ctx.n = ps, n
        return _gather_token_blocks(x, ps, n)

    @staticmethod
    def backward(ctx, g):
        lo, hi = _token_block(ctx.n, ctx.ps)
        return g[lo:hi].contiguous(), None, None


def split_tokens(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """This TP rank's block of the rows of a replicated `x` `[n, ...]`."""
    return _SplitTokens.apply(x, ps) if ps.tp > 1 else x


def gather_tokens(x: torch.Tensor, ps: ParallelState, n: int) -> torch.Tensor:
    """All `n` rows from every TP rank's block (`split_tokens`'s inverse)."""
    return _GatherTokens.apply(x, ps, n) if ps.tp > 1 else x


def sync_sequence_parallel_grads(modules, ps: ParallelState) -> None:
    """All-reduce over TP the gradients of replicated parameters whose gradient is partial per TP rank.

    Under sequence parallelism, norms and row-parallel biases see only this rank's slice
    of the sequence; with or without it, MoE routers and experts see only this rank's
    tokens and Qwen3's q/k norms only its heads; so each TP rank holds a partial gradient.
    Summing over TP once per step (not per micro-batch) restores the full one. Which
    parameters of `modules`: those whose role says `sequence_parallel`. This is the plain
    `.grad` path; under the data-parallel wrapper, `DataParallel.finish_grad_sync` sums
    the same parameters' owned shards. The rows replicated KV heads copy are summed over their holders.
    """
    if ps.tp == 1:
        return
    named = [(p, role) for m in modules for _, p, role in named_roles(m) if p.grad is not None]
    all_reduce_coalesced([p.grad for p, role in named if role.sequence_parallel], ps.tp_group)
    shared = []
    for p, role in named:
        span = role.shared_span(p.shape)
        if span is not None:
            shared.append((p.grad.view(-1)[span[0]:span[1]], role.shared_by))
    sum_shared_rows(shared, ps)


def sum_shared_rows(grads: list[tuple[torch.Tensor, int]], ps: ParallelState) -> None:
    """Sum in place, over their holders, the gradients of rows that `n` consecutive TP ranks hold copies of
    (replicated KV heads, `ParamRole.shared_rows`): `grads` is (gradient view, n) pairs; one coalesced
    all-reduce per n."""
    by_block: dict[int, list[torch.Tensor]] = {}
    for g, n in grads:
        by_block.setdefault(n, []).append(g)
    for n, tensors in by_block.items():
        all_reduce_coalesced(tensors, ps.tp_block_group(n))


def all_reduce_coalesced(tensors: list[torch.Tensor], group) -> None:
    """Sum `tensors` in place over `group` with one flat all-reduce per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        torch._foreach_copy_(same, [f.view_as(t) for f, t in zip(flat.split([t.numel() for t in same]), same)])
