"""Token dispatch for expert parallelism: each routed copy of a token goes to the rank holding its expert, and back.

A MoE layer routes each of its n tokens to k experts: n·k (token, expert) assignments,
numbered `a = token * k + slot`. The E experts are laid out contiguously over the EP
group: EP rank j holds experts [j·E/ep, (j+1)·E/ep). `dispatch`

1. sorts the assignments by expert (stable, so equal experts keep token order); sorted
   by expert is also sorted by destination rank;
2. exchanges the per-expert counts (an all-to-all of an [E] count vector: rank j
   receives each source's counts for its own E/ep experts), so every rank knows how
   many rows each source sends it for each local expert;
3. sends the sorted token rows with one all-to-all (autograd-aware: the backward pass
   is the same exchange in reverse);
4. reorders the received rows (grouped by source, then expert) expert-major, so the
   local experts run one after another on contiguous rows (or as one grouped matmul).

`combine` undoes 4 and 3 and returns the expert outputs in the order of step 1: the
assignments sorted by expert (`Dispatched.order`), which is the order the MoE layer
weights and sums them per token in (`models/moe.py`), so EP = 1 and EP > 1 add a
token's expert outputs in the same order. At EP = 1 steps 2 and 3 vanish, dispatch is
a sort and combine returns its input. The split sizes of an all-to-all must be known on the host, so
each dispatch synchronises once with the device (reading the counts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """Rows `[sum(send), ...]` out, `[sum(recv), ...]` in; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


@dataclass
class Dispatched:
    """What `combine` needs to bring the expert outputs back, plus the local experts' row counts."""

    rows: torch.Tensor  # [R, h]: this rank's received token rows, expert-major
    tokens_per_expert: list[int]  # rows of each local expert, in order (sum R)
    counts: torch.Tensor  # [E] int64: this rank's routed slots per expert (global ids), before any exchange
    order: torch.Tensor  # assignments sorted by expert
    token: torch.Tensor  # the token of each assignment in `order` (`order // k`): where its output is summed
    send: list[int]  # rows sent to each EP rank
    recv: list[int]  # rows received from each EP rank
    expert_major: torch.Tensor  # received-row index of each expert-major row


class TokenDispatcher:
    """Dispatch and combine over `group` (the EP group; None at EP = 1) for `num_experts` experts."""

    def __init__(self, num_experts: int, ep: int, group):
        if num_experts % ep:
            raise ValueError(f"{num_experts} experts cannot be split over EP={ep}")
        self.num_experts, self.ep, self.group = num_experts, ep, group
        self.local = num_experts // ep

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor) -> Dispatched:
        """Send token rows `x` `[n, h]` to the experts `experts` `[n, k]` (global expert ids) picked for them."""
        k = experts.shape[1]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // k
        rows = x[token]
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.ep == 1:
            return Dispatched(rows, counts.tolist(), counts, order, token, [], [], torch.empty(0))
        # received[s, e]: rows source s sends for local expert e
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(self.ep, self.local)
        send = counts.view(self.ep, self.local).sum(1).tolist()
        recv = received.sum(1).tolist()
        rows = _AllToAll.apply(rows, send, recv, self.group)
        start = (received.reshape(-1).cumsum(0) - received.reshape(-1)).view(self.ep, self.local)
        spans = [(s, e) for e in range(self.local) for s in range(self.ep)]
        cnt, off = received.tolist(), start.tolist()
        expert_major = torch.cat([torch.arange(off[s][e], off[s][e] + cnt[s][e]) for s, e in spans]) \
            .to(rows.device)
        return Dispatched(rows[expert_major], received.sum(0).tolist(), counts, order, token, send, recv,
                          expert_major)

    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        """Expert outputs `y` `[R, h]` (rows as dispatched) back to this rank, `[n·k, h]` in `d.order`."""
        if self.ep == 1:
            return y
        return _AllToAll.apply(y[torch.argsort(d.expert_major)], d.recv, d.send, self.group)


def local_experts(num_experts: int, ep: int, ep_rank: int) -> range:
    """The global indices of the experts EP rank `ep_rank` holds: a contiguous block of `num_experts / ep`."""
    local = num_experts // ep
    return range(ep_rank * local, (ep_rank + 1) * local)
