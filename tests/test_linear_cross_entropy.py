"""The LM head + cross-entropy backward in bf16 (parallel/linear_cross_entropy.py).

The weight gradient's products are fp32 and go straight into an fp32 `main_grad`
(what the optimizer's grad buffers hold, given to the weight as its `grad_sink`),
never rounded to bf16 on the way. The fp32 path keeps its own tests
(tests/test_tp_parity.py, tests/test_wgrad_fusion.py).
"""

from __future__ import annotations

import pytest
import torch

from bounds import assert_close

from helpers import make_ps
from hfmeg.parallel.linear_cross_entropy import linear_cross_entropy

V, H, T = 96, 32, 24


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).bfloat16().requires_grad_()
    w = torch.nn.Parameter(torch.randn(V, H, generator=g).bfloat16())
    target = torch.randint(0, V, (T,), generator=g)
    target[3] = -100
    return x, w, target


def _reference(x, w, target):
    """fp64 maths on the same bf16 values: softmax - onehot in fp32, rounded once to bf16, as the GEMMs see it."""
    z = (x.detach() @ w.detach().t()).float()
    d = torch.softmax(z, -1) - torch.nn.functional.one_hot(target.clamp_min(0), V).float()
    d[target < 0] = 0
    d = d.bfloat16().double()
    return d @ w.detach().double(), d.t() @ x.detach().double()


def test_bf16_weight_gradient_lands_unrounded_in_fp32_main_grad():
    ps = make_ps(world=1)
    x, w, target = _inputs()
    main_grad = torch.full((V, H), 0.5)  # what earlier micro-batches left there
    w.grad_sink = main_grad  # as the DP wrapper gives it
    linear_cross_entropy(x, w, target, ps, V, chunk_tokens=10).sum().backward()
    grad_x, grad_w = _reference(x, w, target)
    assert w.grad is None  # everything went into main_grad
    assert_close(main_grad.double() - 0.5, grad_w, rtol=1e-5, atol=1e-6)
    # bf16 output: its own rounding (<= half a bf16 eps = 3.9e-3 relative), the fp32 GEMM's (~V eps32, negligible),
    # and d's rounding to bf16, which an fp32 ulp of difference in the chunked softmax can move by one bf16 ulp
    # for a few terms: rtol 1e-2 ~ 1.3 bf16 eps, atol for outputs near 0 (measured/bound 0.33 on the 2-core VM).
    assert_close(x.grad.double(), grad_x, rtol=1e-2, atol=1e-3)


def test_bf16_weight_without_main_grad_gets_its_gradient_from_autograd():
    ps = make_ps(world=1)
    x, w, target = _inputs()
    linear_cross_entropy(x, w, target, ps, V, chunk_tokens=10).sum().backward()
    _, grad_w = _reference(x, w, target)
    assert w.grad.dtype == torch.bfloat16
    # Each side rounds its sum to bf16 once (from fp32 here, from float64 there): at most one bf16 ulp apart,
    # <= eps relative (measured/bound ~0.6 is this rounding itself, not a margin that can shrink).
    assert_close(w.grad, grad_w.bfloat16(), rtol=torch.finfo(torch.bfloat16).eps, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16 GEMMs with fp32 output)")
def test_bf16_weight_gradient_in_fp32_main_grad_on_cuda():
    ps = make_ps(world=1, device="cuda")
    x, w, target = _inputs()
    x, target = x.detach().cuda().requires_grad_(), target.cuda()
    w = torch.nn.Parameter(w.detach().cuda())
    main_grad = torch.zeros(V, H, device="cuda")
    w.grad_sink = main_grad
    linear_cross_entropy(x, w, target, ps, V, chunk_tokens=10).sum().backward()
    _, grad_w = _reference(x, w, target)
    assert w.grad is None
    assert_close(main_grad.double(), grad_w, rtol=1e-4, atol=1e-5)
