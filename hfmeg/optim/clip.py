"""Global gradient norm over DP shards, TP ranks and PP stages, and clipping.

Each rank sums the squares of the gradient elements it owns and is responsible
for; one all-reduce adds the partial sums. Ownership rules make every element of
the unsharded model count exactly once:

- sharded modes: DP rank r owns shard r of every bucket (padding is zero), and the
  world sums. With expert parallelism an expert bucket is sharded over its
  expert-DP group instead: the ranks with EP rank j own the shards of EP rank j's
  experts, so over the world each expert element is still owned exactly once;
- `ddp`: every DP replica holds everything, so only the model-parallel group sums.
  With EP no replica holds every expert: a bucket counts on the first rank of its
  group (DP rank 0; expert-DP rank 0 for experts, one per EP rank) and the world sums;
- TP-replicated parameters (role `tp_dim` None: norms, row-parallel biases, learned
  positions) count on TP rank 0 only;
- a tied embedding copy on the last stage (role `tied_copy`) does not count; the
  first stage's `embed.weight` does (`ParamRole.counted_on`).

Clipping then matches `torch.nn.utils.clip_grad_norm_`: grads are multiplied by
min(1, max_norm / (norm + 1e-6)).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """This rank's fp64 sum of squares of `grads`, a 0-d tensor on `device`.

    `device` is the norm all-reduce's device: a rank that counts no gradients (all its
    shard is padding, or it holds only TP-replicated parameters on TP rank > 0) still
    joins the collective, and NCCL takes no CPU tensor.
    """
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(torch._foreach_norm(grads)).double().square().sum()


def global_norm(grads: list[torch.Tensor], group, reduce: bool, device: torch.device) -> float:
    """sqrt of the sum of squares of `grads`, summed over `group` when `reduce`."""
    sq = sum_of_squares(grads, device)
    if reduce:
        dist.all_reduce(sq, group=group)
    return sq.sqrt().item()


def clip_coefficient(norm: float, max_norm: float) -> float:
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
