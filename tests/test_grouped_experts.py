"""Grouped MoE experts (models/grouped_linear.py, models/moe.py): the grouped GEMMs against a per-expert loop,
and the host reads of a MoE layer.

Bound for the grouped products (fp32). Every element of y = x w^T, dx = dy w and
dw = dy^T x is a dot product of length n (K, N or the group's rows) computed in fp32 by
two different kernels; each is within n·u·sum|a_i b_i| of the exact value (u = 2^-24,
the classic bound for a sum of n rounded products), so the two differ by at most
2·n·u·(|A| |B|) elementwise, whatever order either sums in. The fallback loop and the
reference must agree within the same bound.

Host reads: at EP = 1 a MoE layer's forward and backward must not read anything on the
host (on a GPU each read waits for the device). On CPU that is checked by making every
Python-level host read (`tolist`, `item`, `int()`/`float()`/`bool()` of a tensor,
`bincount`) raise while the layer runs forward and backward. At EP = 2 the all-to-all
needs its split sizes: exactly one read per layer forward, none in the backward.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from helpers import make_ps, moe_layer
from hfmeg.models.grouped_linear import _fits, grouped_linear
from hfmeg.parallel.launch import spawn

U = 2.0 ** -24


def _bound(a: torch.Tensor, b: torch.Tensor, n: int) -> torch.Tensor:
    """2·n·u·(|a| |b|): the most two fp32 evaluations of the products `a @ b` (inner length n) can differ by."""
    return 2 * n * U * (a.double().abs() @ b.double().abs()) + 1e-30


def _loop(x, w, counts):
    """The per-expert reference: expert g's rows times w[g]^T, one `mm` each, autograd's own backward."""
    return torch.cat([xg @ w[g].T for g, xg in enumerate(x.split(counts))])


@pytest.mark.parametrize("fused", [False, True], ids=["autograd", "into_main_grad"])
@pytest.mark.parametrize("k,n", [(32, 48), (5, 7)], ids=["grouped_mm", "fallback"])
def test_grouped_linear_matches_per_expert_loop(k, n, fused):
    """`fused`: the weight has an fp32 main grad as its sink (parallel/wgrad.py), which takes the weight
    gradient (added onto what it held); autograd then gets none."""
    torch.manual_seed(0)
    counts = [3, 0, 9, 1]  # an expert without tokens included
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(sum(counts), k, requires_grad=True)
    w = torch.randn(len(counts), n, k, requires_grad=True)
    dy = torch.randn(sum(counts), n)
    assert _fits(x) == _fits(w.transpose(1, 2)) == (k % 4 == 0)  # which path runs

    held = torch.randn(w.shape)
    if fused:
        w.grad_sink = held.clone()
    y = grouped_linear(x, w, offs)
    y.backward(dy)
    dx, dw = x.grad, w.grad
    if fused:
        assert dw is None
        dw = w.grad_sink - held
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    yr = _loop(xr, wr, counts)
    dxr, dwr = torch.autograd.grad(yr, (xr, wr), dy)

    xs, dys = x.detach().split(counts), dy.split(counts)
    y_bound = torch.cat([_bound(xg, w[g].detach().T, k) for g, xg in enumerate(xs)])
    dx_bound = torch.cat([_bound(dg, w[g].detach(), n) for g, dg in enumerate(dys)])
    dw_bound = torch.stack([_bound(dg.T, xg, max(len(xg), 1)) for dg, xg in zip(dys, xs)])
    assert ((y - yr).abs() <= y_bound).all()
    assert ((dx - dxr).abs() <= dx_bound).all()
    if fused:  # adding onto `held` and taking it off again: two more roundings, each of at most u·|sum|
        dw_bound = dw_bound + 2 * U * (held.double().abs() + dwr.detach().double().abs())
    assert ((dw - dwr).abs() <= dw_bound).all()
    assert torch.equal(dw[1], torch.zeros(n, k))  # an expert without tokens: a zero gradient, not none


@contextmanager
def _counting_host_reads(raise_on_read: bool):
    """Count (or refuse) every Python-level read of a tensor's value on the host."""
    reads = []
    names = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")
    saved = {n: getattr(torch.Tensor, n) for n in names}
    saved_bincount = torch.bincount

    def spy(name, original):
        def read(self, *args, **kwargs):
            reads.append(name)
            if raise_on_read:
                raise AssertionError(f"host read: Tensor.{name}")
            return original(self, *args, **kwargs)
        return read

    def no_bincount(*args, **kwargs):
        raise AssertionError("host read: bincount")

    try:
        for n in names:
            setattr(torch.Tensor, n, spy(n, saved[n]))
        torch.bincount = no_bincount
        yield reads
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
        torch.bincount = saved_bincount


def test_moe_layer_reads_nothing_on_the_host_at_ep1():
    layer = moe_layer()
    x = torch.randn(6, 2, 32, requires_grad=True)
    with _counting_host_reads(raise_on_read=True):
        y = layer(x)
        y.backward(torch.randn_like(y))
    assert layer.experts.fc1.grad is not None and x.grad is not None


def _reads_at_ep2():
    ps = make_ps(ep=2)
    layer = moe_layer(ps)
    torch.manual_seed(2 + ps.rank)
    x = torch.randn(5, 1, 32, requires_grad=True)
    with _counting_host_reads(raise_on_read=False) as forward:
        y = layer(x)
    with _counting_host_reads(raise_on_read=False) as backward:
        y.backward(torch.randn_like(y))
    return forward, backward


def test_moe_layer_reads_the_split_sizes_once_at_ep2():
    for forward, backward in spawn(_reads_at_ep2, 2):
        assert forward == ["tolist"] and backward == []
