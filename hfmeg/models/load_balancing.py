"""HF's load-balancing (aux) loss over every MoE layer of the model, on one stage or across a pipeline.

transformers' `load_balancing_loss_func` over one forward: with, summed over every MoE
layer of the model, `C_e` the top-k slots routed to expert e, `P_e` the tokens' router
probabilities of e, and `R` the number of (layer, token) rows,

    aux = E * sum_e (C_e / R) * (P_e / R)

one product of model-wide means, not a sum of per-layer losses. C and R carry no
gradient; P does, and d aux / d P_e = E * C_e / R^2 is the same for every layer. So each
layer's router needs only the model-wide C and R to get its exact gradient.

The router sums: one flat float64 tensor `[P (E) | C (E) | R (1)]`. Each model chunk adds
its own MoE layers' sums of the micro-batch to the sums of the chunks before it
(`add_router_sums`); the last chunk turns the total into the loss (`load_balancing_loss`).
With one chunk (PP = 1) that is the whole computation; with a pipeline the pipeline
(`parallel/pipeline.py`) carries the sums beside the activation, as a second, tiny
activation, and gets the gradient back the same way:
- forward: a chunk receives the running sums as a leaf that requires grad, adds its own
  with autograd (`received + own`: P differentiable, C and R plain numbers) and sends the
  total on; the last chunk computes the loss value from the model-wide sums, exactly;
- backward: autograd on the last chunk then yields the loss's gradient w.r.t. the sums it
  received: d aux / d P on the P part (with the micro-batch scaling and the loss scale the
  main loss gets, since it is one backward of one loss), zero on C and R. It goes back
  with the activation gradient, and each earlier chunk passes it as the gradient of the
  sums it sent, a second root of its backward. The adds pass it through unchanged to
  every chunk's own P, so each router's gradient is exactly what one process computes.
Sending the gradient itself (rather than C and R for each stage to rebuild
coef * E * C / R^2 and the scalings) keeps that formula in one place: autograd of the loss.

float64 keeps the counts exact integers at any number of tokens (float32 would round them
above 2^24 slots) and holds the float32 P sums exactly; the loss converts back to the
float32 values the one-stage formula sees, so one chunk (PP = 1) computes bit for bit
what it always did.

Tensor parallelism: each TP rank's sums cover its own share of the tokens (the MoE layer
routes each rank's share), and they travel that way. The loss sums them over TP: P with
`reduce_from_tp`, whose backward leaves each rank the gradient of its own part, C and R
with a plain all-reduce; so the loss and its gradient are the same on every TP rank.
transformers computes this loss's softmax in the logits' dtype, hfmeg reuses the routing's
fp32 probabilities (the same in fp32, the numerics contract's dtype).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.comm import reduce_from_tp
from ..parallel.state import ParallelState
from .moe import RouterStats


def empty_router_sums(num_experts: int, device: torch.device) -> torch.Tensor:
    """A buffer for router sums received from a neighbouring stage."""
    return torch.empty(2 * num_experts + 1, dtype=torch.float64, device=device)


def add_router_sums(received: torch.Tensor | None, stats: list[RouterStats], num_experts: int,
                    device: torch.device) -> torch.Tensor:
    """The router sums through the MoE layers whose routing is `stats`: theirs plus `received`
    (the chunks before; None on the first chunk)."""
    if not stats:
        return received if received is not None else torch.zeros(2 * num_experts + 1, dtype=torch.float64,
                                                                   device=device)
    counts = torch.stack([s.tokens_per_expert for s in stats]).sum(0)
    prob_sum = torch.stack([s.prob_sum for s in stats]).sum(0)
    # A fill, not a copy from the host: on a GPU `torch.tensor(..., device=)` would wait for the device.
    rows = counts.new_full((1,), sum(s.rows for s in stats), dtype=torch.float64)
    own = torch.cat([prob_sum.double(), counts.double(), rows])
    return own if received is None else received + own


def load_balancing_loss(sums: torch.Tensor, num_experts: int, ps: ParallelState) -> torch.Tensor:
    """HF's `load_balancing_loss_func` from the model-wide router sums of one forward (see above)."""
    prob_sum = reduce_from_tp(sums[:num_experts].float(), ps)
    counted = sums[num_experts:].detach().float()
    if ps.tp > 1:
        dist.all_reduce(counted, group=ps.tp_group)
    counts, rows = counted[:-1], counted[-1]
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))
