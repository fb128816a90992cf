"""Expert parallelism: the rank grid's EP groups and the all-to-all token dispatch (parallel/expert_dispatch.py).

The dispatch is checked against the same experts run in one process: every rank routes its
own tokens; with EP = 2 each rank holds half the experts and tokens cross ranks. Outputs and
input gradients must equal the local computation, and each expert's weight gradient must be
the sum over every rank's tokens routed to it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bounds import within

from hfmeg.errors import LayoutError
from hfmeg.models.grouped_linear import grouped_linear
from hfmeg.parallel.expert_dispatch import TokenDispatcher
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.state import ParallelConfig, ParallelState
from optim_harness import FP32_EPS, ROUNDING_FACTOR

E, K, H = 4, 2, 8


def _grid(tp, ep):
    ps = ParallelState(ParallelConfig(tp=tp, ep=ep), dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    return ps.dp_rank, ps.ep_rank, ps.edp_rank, ps.ep_ranks, ps.expert_dp_ranks


def test_ep_groups_split_dp_with_ep_fastest():
    # world 8 = TP 2 x DP 4, EP 2: dp_rank = ep_rank + 2 * edp_rank
    grid = spawn(_grid, 8, 2, 2)
    assert [g[:3] for g in grid] == [(d, d % 2, d // 2) for d in (0, 0, 1, 1, 2, 2, 3, 3)]
    assert grid[0][3] == [0, 2] and grid[1][3] == [1, 3] and grid[4][3] == [4, 6]  # EP: DP neighbours, same TP rank
    assert grid[0][4] == [0, 4] and grid[3][4] == [3, 7]  # expert-DP: the same experts


def test_ep_must_divide_dp():
    with pytest.raises(LayoutError, match="EP=3 does not divide DP=4"):
        ParallelState(ParallelConfig(ep=3), 0, 4, torch.device("cpu"))


def _moe(x, experts, weights, w, dispatcher):
    """Run the routed copies of `x` through this rank's linear experts `w` (`[E_local, H, H]`, y = x w_e^T)
    and combine them per token."""
    d = dispatcher.dispatch(x, experts)
    y = dispatcher.combine(grouped_linear(d.rows, w, d.offsets), d)[torch.argsort(d.order)]
    y = y.view(x.shape[0], experts.shape[1], -1)
    return (y * weights.unsqueeze(-1)).sum(1)


def _dispatch_vs_local(ep):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    w_all = torch.randn(E, H, H)
    torch.manual_seed(100 + rank)  # each rank its own tokens and routing, uneven loads included
    n = 5 + 3 * rank
    x = torch.randn(n, H)
    experts = torch.stack([torch.randperm(E)[:K] for _ in range(n)])
    experts[0] = torch.tensor([0, 1])  # every rank sends something to EP rank 0's experts
    weights = torch.rand(n, K)

    ps = ParallelState(ParallelConfig(ep=ep), rank, world, torch.device("cpu"))
    local = E // ep
    first = ps.ep_rank * local
    w_ep = w_all[first:first + local].clone().requires_grad_()
    x_ep = x.clone().requires_grad_()
    y_ep = _moe(x_ep, experts, weights, w_ep, TokenDispatcher(E, ep, ps.ep_group))
    y_ep.pow(2).sum().backward()

    def local_run(dtype):
        w_ref = w_all.to(dtype).requires_grad_()
        x_ref = x.to(dtype).requires_grad_()
        y_ref = _moe(x_ref, experts, weights.to(dtype), w_ref, TokenDispatcher(E, 1, None))
        y_ref.pow(2).sum().backward()
        g_ref = w_ref.grad.clone()
        dist.all_reduce(g_ref, group=ps.ep_group)  # an expert's gradient: every EP rank's tokens routed to it
        return y_ref.detach(), x_ref.grad, g_ref[first:first + local]

    # The same computation in float64 is the truth; the local fp32 run's distance from it is what fp32 rounding
    # does here (the EP path sums the same products in other GEMM shapes and orders), as optim_harness bounds it.
    exact, fp32 = local_run(torch.float64), local_run(torch.float32)
    rows = []
    for ours, want, ref32 in zip((y_ep.detach(), x_ep.grad, w_ep.grad), exact, fp32):
        bound = ROUNDING_FACTOR * (ref32.double() - want).abs().max().item() + 4 * FP32_EPS * want.abs().max().item()
        rows.append(((ours.double() - want).abs().max().item(), bound))
    return rows


@pytest.mark.parametrize("ep", [2, 4])
def test_dispatch_over_ep_equals_local_experts(ep):
    for rows in spawn(_dispatch_vs_local, ep, ep):
        for what, (diff, bound) in zip(("y", "x.grad", "w.grad"), rows):
            within(diff, bound, f"{what} vs float64 (rounding)", rows)
