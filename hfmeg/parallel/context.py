"""Context parallelism (CP): every sequence split over the `cp` ranks of a CP group.

Load-balanced split. A sequence of `s` tokens is cut into `2 * cp` equal chunks and
CP rank r holds chunks r and 2·cp−1−r, in that order (`token_index`, with the micro-batch type
in data/microbatch.py, which sits below this package). Under a causal
mask the work of a query grows with its position, so pairing an early chunk with the
matching late one gives every rank the same number of (query, key) pairs; a
contiguous split would leave the last rank with 2·cp−1 times the first's.

What follows the tokens. A micro-batch's `[b, s]` tensors (`input_ids`, `labels`,
`position_ids`, `segment_ids`) are cut the same way, by `MicroBatch.shard(cp_rank, cp)`
(data/microbatch.py), which the data pipeline calls on the rows it builds and a caller
holding whole rows calls itself; the model and the pipeline schedule take a CP rank's
tokens (`forward_backward`'s micro-batches are `[b, s / cp]`). So each
token keeps its label, its loss-mask entry and its RoPE position (the position ids
are selected, never recomputed from the local index: RoPE rotates every token by its
true position, and packed documents keep their restarting positions). Everything
between attentions is per token, so a rank runs the embedding, the MLPs, the norms
and the head on its tokens alone. The loss of a micro-batch is still the sum of its
per-token losses divided by the global batch's label-token count (the pipeline's
`num_tokens`, counted over whole rows): each CP rank contributes the sum over its own
tokens, and the gradient reduction sums over DP x CP (`ParallelState.dp_cp_group`),
so loss and gradients are the CP = 1 ones. Padding (label −100) counts nowhere.

Attention across the split: all-gather of K/V (`gather_kv`), not a ring. Each
layer all-gathers the rotated keys and values of every CP rank (one collective, K and
V stacked) and attends its local queries over the whole sequence; the backward is
the conjugate reduce-scatter, which sums every rank's dK/dV for the keys a rank holds.
Why this and not a ring of K/V blocks with an online-softmax merge (Megatron's
default): with GQA the K/V are `2 * kv_heads / heads` of the activations (a quarter
or less for LLaMA-family models), so gathering them costs little memory next to the
queries, MLP and logits the split divides; one collective per layer replaces 2·(cp−1)
dependent send/receive steps; and any mask works unchanged, in particular the
packed-document causal mask, which under a ring needs per-block bookkeeping of which
(query, key) block pairs are empty. Llama 3 made the same choice for document masks.
The cost is that the gathered K/V, `[b, kv_heads, s, d]`, is whole on every rank.

Packed documents: the mask of a local query block is built (models/document_attention.py)
from the queries' sequence positions (`token_index`), the gathered keys' positions
(`gathered_index`) and both sides' document ids: the queries' are the micro-batch's
`segment_ids`, the keys' are read from the whole rows' ids it carries (`row_segment_ids`,
set by `MicroBatch.shard`) in gathered order, with no collective,
so the mask can be built before the step (models/staging.py). It is causal in the row's
order and never crosses documents. The per-block computation is the model's own
`attend` (SDPA with that mask, additive and built once per micro-batch; flex attention
with a block mask on CUDA).
"""

from __future__ import annotations

import torch

from ..data.microbatch import token_index
from .comm import all_gather_flat, conjugate_pair, reduce_scatter_flat
from .state import ParallelState


def gathered_index(s: int, cp: int, device=None) -> torch.Tensor:
    """The row positions of an all-gathered sequence: every rank's tokens, in rank order (`token_index`)."""
    return torch.cat([token_index(s, cp, r, device) for r in range(cp)])


def local_positions(b: int, s_local: int, ps: ParallelState, device) -> torch.Tensor:
    """The default position ids `[b, s_local]` of this rank's tokens (one document per row)."""
    if ps.cp == 1:  # any length, also one that 2 chunks would not divide
        return torch.arange(s_local, device=device).unsqueeze(0).expand(b, s_local)
    return token_index(s_local * ps.cp, ps.cp, ps.cp_rank, device).unsqueeze(0).expand(b, s_local)


def _gather(x: torch.Tensor, ps: ParallelState, dim: int) -> torch.Tensor:
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] * ps.cp,) + tuple(x.shape[1:]))
    all_gather_flat(out, x, group=ps.cp_group)
    return out.movedim(0, dim)


KV_SEQ_DIM = 3  # the sequence dim of K and V stacked for one collective: [2, b, kv_heads, s, d]


def _reduce_scatter(g: torch.Tensor, ps: ParallelState, dim: int) -> torch.Tensor:
    g = g.movedim(dim, 0).contiguous()
    out = g.new_empty((g.shape[0] // ps.cp,) + tuple(g.shape[1:]))
    reduce_scatter_flat(out, g, group=ps.cp_group)
    return out.movedim(0, dim)


# All-gather over CP; backward: reduce-scatter, each rank's share of every rank's gradient.
_gather_kv = conjugate_pair("GatherKV", lambda kv, ps: _gather(kv, ps, KV_SEQ_DIM),
                            lambda g, ps: _reduce_scatter(g, ps, KV_SEQ_DIM), size=lambda ps: ps.cp)


def gather_kv(k: torch.Tensor, v: torch.Tensor, ps: ParallelState) -> tuple[torch.Tensor, torch.Tensor]:
    """Every CP rank's keys and values `[b, kv_heads, s / cp, d]` in rank order (`gathered_index`),
    in one collective; differentiable."""
    if ps.cp == 1:
        return k, v
    return _gather_kv(torch.stack((k, v)), ps).unbind(0)
