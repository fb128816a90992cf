"""Finish a step's gradients on the plain `.grad` path (no overlapped optimizer).

After `forward_backward`, each rank's `.grad` holds its share of the
global-batch-mean gradient. Three sums make it the full gradient everywhere:

1. Sequence parallelism: norm weights (and row-parallel biases) saw only this
   TP rank's slice of the sequence, so their gradients are summed over TP.
2. Tied embeddings across stages: the first stage's `embed.weight` and the last
   stage's `lm_head.weight` (roles with `tied="embedding"`) are one tensor of the
   model, so their gradients are summed over the embedding group and both copies
   keep taking identical optimizer steps.
3. Data parallelism: every replica saw different micro-batches of the same
   global batch; losses are already divided by the global token count, so the
   replicas' gradients are summed (not averaged) over DP.
"""

from __future__ import annotations

import torch

from .comm import all_reduce_coalesced, sync_sequence_parallel_grads
from .roles import named_roles
from .state import ParallelState


def embedding_grads(chunks, ps: ParallelState) -> list[torch.Tensor]:
    """The tied-embedding copies on this rank whose gradients are summed over `ps.embedding_group`."""
    if ps.pp == 1:
        return []
    return [p for c in chunks for _, p, role in named_roles(c) if role.tied == "embedding"]


def finalize_grads(chunks, ps: ParallelState) -> None:
    """Sum gradients over TP (SP params), the embedding group (tied copies) and DP."""
    params = [p for c in chunks for p in c.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    sync_sequence_parallel_grads(chunks, ps)
    tied = embedding_grads(chunks, ps)
    if tied:
        all_reduce_coalesced([p.grad for p in tied], ps.embedding_group)
    if ps.dp > 1:
        all_reduce_coalesced([p.grad for p in params], ps.dp_group)
