"""Token dispatch for expert parallelism: each routed copy of a token goes to the rank holding its expert, and back.

A MoE layer routes each of its n tokens to k experts: n·k (token, expert) assignments,
numbered `a = token * k + slot`. The E experts are laid out contiguously over the EP
group: EP rank j holds experts [j·E/ep, (j+1)·E/ep). `dispatch`

1. sorts the assignments by expert (stable, so equal experts keep token order); sorted
   by expert is also sorted by destination rank; counts the assignments per expert on
   the device (a scatter-add: `bincount` would read its input's maximum on the host);
2. exchanges the per-expert counts (an all-to-all of an [E] count vector: rank j
   receives each source's counts for its own E/ep experts), so every rank knows how
   many rows each source sends it for each local expert;
3. sends the sorted token rows with one all-to-all (autograd-aware: the backward pass
   is the same exchange in reverse);
4. reorders the received rows (grouped by source, then expert) expert-major, so the
   local experts' rows are contiguous blocks, one group each of the grouped GEMMs
   (`models/grouped_linear.py`), whose running ends (`Dispatched.offsets`) stay on the device.

`combine` undoes 4 and 3 and returns the expert outputs in the order of step 1: the
assignments sorted by expert (`Dispatched.order`), which is the order the MoE layer
weights and sums them per token in (`models/moe.py`), so EP = 1 and EP > 1 add a
token's expert outputs in the same order.

Host reads. At EP = 1 steps 2 and 3 vanish, dispatch is a sort, combine returns its
input, and nothing is read on the host. At EP > 1 the all-to-all of step 3 needs its split
sizes on the host: the sent and received counts travel in ONE device-to-host copy per
layer (`HostCopy`), started as soon as the count exchange is queued (non-blocking, into
pinned memory on a GPU) and waited for only when step 3 is issued, after the row gather
has been queued behind it; the backward reuses those sizes.
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


class HostCopy:
    """A device tensor's copy on the host, started at construction and read with `wait` (see the module
    docstring: on a GPU a non-blocking copy into pinned memory; on CPU the tensor itself)."""

    def __init__(self, t: torch.Tensor):
        self._done = None
        if t.is_cuda:
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host = t

    def wait(self) -> list:
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()


@dataclass
class Dispatched:
    """What `combine` needs to bring the expert outputs back, plus the local experts' row groups."""

    rows: torch.Tensor  # [R, h]: this rank's received token rows, expert-major
    offsets: torch.Tensor  # [E/ep] int32, on the device: where each local expert's rows end (the last is R)
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
        counts = flat.new_zeros(self.num_experts).scatter_add_(0, flat, torch.ones_like(flat))
        if self.ep == 1:
            return Dispatched(x[token], _ends(counts), counts, order, token, [], [], torch.empty(0))
        # received[s, e]: rows source s sends for local expert e
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        sizes = HostCopy(torch.cat([counts.view(self.ep, self.local).sum(1), received.view(self.ep, -1).sum(1)]))
        rows = x[token]
        send, recv = _halves(sizes.wait())
        rows = _AllToAll.apply(rows, send, recv, self.group)
        # Each received row's local expert, from its (source, expert) block; a stable sort by it is expert-major.
        blocks = torch.arange(self.num_experts, device=x.device).repeat_interleave(received, output_size=sum(recv))
        expert_major = torch.argsort(blocks % self.local, stable=True)
        return Dispatched(rows[expert_major], _ends(received.view(self.ep, self.local).sum(0)), counts, order,
                          token, send, recv, expert_major)

    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        """Expert outputs `y` `[R, h]` (rows as dispatched) back to this rank, `[n·k, h]` in `d.order`."""
        if self.ep == 1:
            return y
        return _AllToAll.apply(y[torch.argsort(d.expert_major)], d.recv, d.send, self.group)


def _ends(counts: torch.Tensor) -> torch.Tensor:
    """The running ends of consecutive groups of `counts` rows: the grouped GEMMs' offsets (int32, as they take)."""
    return counts.cumsum(0).to(torch.int32)


def _halves(sizes: list[int]) -> tuple[list[int], list[int]]:
    half = len(sizes) // 2
    return sizes[:half], sizes[half:]


def local_experts(num_experts: int, ep: int, ep_rank: int) -> range:
    """The global indices of the experts EP rank `ep_rank` holds: a contiguous block of `num_experts / ep`."""
    local = num_experts // ep
    return range(ep_rank * local, (ep_rank + 1) * local)
