"""DeepSeek-V3's router (`MoEConfig.scoring == "sigmoid"`), as transformers' DeepseekV3TopkRouter computes it:

1. scores = sigmoid(router logits) in fp32;
2. for the choice only, the per-expert correction bias is added (`ScoreBias`); the experts are `n_group` contiguous
   groups, a group's rank is the sum of its two best biased scores, and only the `topk_group` best groups' experts
   may be chosen; each token takes the top-k biased scores among those;
3. a chosen expert's weight is its unbiased score, renormalised over the k (`norm_topk_prob`, with transformers'
   1e-20 in the denominator) and times `routed_scaling_factor`; the weighted sum stays in fp32 until each expert's
   weighted output is cast back (`combine_fp32`), as transformers' loop does.

The correction bias is not a trained parameter: it is a frozen one (so conversion, shard files and resumption carry
it like any weight), kept in fp32 whatever the model's dtype, as transformers keeps it. It moves by DeepSeek-V3's
aux-loss-free balancing instead (`update_score_biases`, called by the optimizer's step): after each step that is not
skipped, every expert's bias += u * sign(mean load - its load), the load being the routed slots of the step's
training forwards (every micro-batch, every rank's tokens) and u `optim.router_bias_update_rate`. A forward
without gradients (evaluation, a frozen reference) or repeated in backward (recompute) is not counted, nor a layer
whose router is frozen (LoRA: its bias stays as loaded).
"""

from __future__ import annotations

import torch
from torch import nn

import torch.distributed as dist

from ..config import MoEConfig
from ..parallel.roles import ParamRole, add_param
from ..parallel.state import ParallelState


class ScoreBias(nn.Module):
    """One MoE layer's `e_score_correction_bias` `[experts]`: fp32, frozen, replicated on every rank."""

    def __init__(self, experts: int):
        super().__init__()
        add_param(self, "bias", experts, role=ParamRole("bias"))
        self.bias.requires_grad_(False)
        self.load: torch.Tensor | None = None  # this rank's routed slots per expert since the last update

    def count(self, counts: torch.Tensor) -> None:
        """Add a forward's routed slots per expert `counts`, if it is a training forward (see the module doc)."""
        # -1: not inside a backward pass, where a recomputed forward would count its tokens twice.
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            self.load = counts if self.load is None else self.load + counts

    def _apply(self, fn, recurse=True):
        # `.to(dtype)` of the model moves the bias to the new device but leaves it fp32.
        return super()._apply(lambda t: t.to(device=fn(t).device), recurse)


def sigmoid_grouped_topk(logits: torch.Tensor, bias: torch.Tensor | None, m: MoEConfig):
    """(weights `[n, k]` fp32, chosen experts `[n, k]`, scores `[n, experts]` fp32) for router logits `[n, experts]`."""
    scores = torch.sigmoid(logits.float())
    choice = scores if bias is None else scores + bias
    n, experts = choice.shape
    per_group = experts // m.n_group
    group_rank = choice.view(n, m.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    best = group_rank.topk(m.topk_group, dim=-1, sorted=False)[1]
    eligible = torch.zeros_like(group_rank).scatter_(1, best, 1.0).bool().repeat_interleave(per_group, dim=1)
    chosen = choice.masked_fill(~eligible, float("-inf")).topk(m.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, chosen)
    if m.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * m.routed_scaling_factor, chosen, scores


def update_score_biases(chunks: list[nn.Module], ps: ParallelState, rate: float) -> None:
    """Move every correction bias of this rank's MoE layers by `rate` * sign(mean load - load), the load summed
    over the world's ranks (one all-reduce, on every rank when `rate` > 0), and restart the counts. `rate` 0 (a
    skipped step) only restarts them."""
    biases = {int(i): layer.mlp.score_bias for chunk in chunks for i, layer in chunk.layers.items()
              if hasattr(layer.mlp, "score_bias")}
    m = chunks[0].cfg.moe
    loads = None if rate == 0 else torch.zeros(len(m.sparse_layers), m.num_experts, dtype=torch.int64,
                                               device=ps.device)
    for i, b in biases.items():
        if loads is not None and b.load is not None:
            loads[m.sparse_layers.index(i)] += b.load
        b.load = None
    if loads is None:
        return
    if ps.world_size > 1:
        dist.all_reduce(loads)
    with torch.no_grad():
        for i, b in biases.items():
            load = loads[m.sparse_layers.index(i)].float()
            if load.sum() > 0:  # a layer no training forward counted (its router frozen) keeps its bias
                b.bias.add_(rate * torch.sign(load.mean() - load))
