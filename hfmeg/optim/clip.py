"""Global gradient norm over DP shards, TP ranks and PP stages, and clipping.

Each rank sums the squares of the gradient elements it owns and is responsible
for; one all-reduce adds the partial sums. Ownership rules make every element of
the unsharded model count exactly once:

- sharded modes: DP rank r owns shard r of every bucket (padding is zero);
  `ddp`: every DP replica holds everything, so only the model-parallel group sums;
- TP-replicated parameters (norms, row-parallel biases, learned positions: split
  kind `replicated` in `checkpoint.rules`) count on TP rank 0 only;
- a tied embedding copy on the last stage (`shared_embedding`) does not count; the
  first stage's `embed.weight` does.

Clipping then matches `torch.nn.utils.clip_grad_norm_`: grads are multiplied by
min(1, max_norm / (norm + 1e-6)).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def global_norm(grads: list[torch.Tensor], group, reduce: bool) -> float:
    """sqrt of the sum of squares of `grads`, summed over `group` when `reduce`."""
    device = grads[0].device if grads else torch.device("cpu")
    if grads:
        norms = torch._foreach_norm(grads)
        sq = torch.stack(norms).double().square().sum()
    else:
        sq = torch.zeros((), dtype=torch.float64, device=device)
    if reduce:
        dist.all_reduce(sq, group=group)
    return sq.sqrt().item()


def clip_coefficient(norm: float, max_norm: float) -> float:
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
