"""The gradient-norm pieces that need no process group."""

from __future__ import annotations

import torch

from bounds import assert_close
from hfmeg.optim.clip import sum_of_squares


def test_empty_sum_of_squares_is_on_the_collective_device():
    """A rank that counts no gradients must still hand NCCL a tensor on its device, never a CPU one."""
    sq = sum_of_squares([], torch.device("meta"))
    assert sq.device.type == "meta" and sq.dtype == torch.float64 and sq.shape == ()
    assert sum_of_squares([], torch.device("cpu")).item() == 0.0


def test_sum_of_squares_matches_the_squared_norm():
    grads = [torch.randn(7, 3, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    want = torch.cat([g.reshape(-1) for g in grads]).double().square().sum()
    # Each tensor's fp32 norm sums n positive squares (relative error <= n eps, no cancellation), then a square
    # root and, in float64, its square: (n + 2) eps relative at most.
    rtol = (max(g.numel() for g in grads) + 2) * torch.finfo(torch.float32).eps
    assert_close(sum_of_squares(grads, torch.device("cpu")), want, rtol=rtol, atol=0.0)
