"""The LM head + cross-entropy backward in bf16 (parallel/linear_cross_entropy.py).

The weight gradient's products are fp32 and go straight into an fp32 `main_grad`
(what the optimizer's grad buffers hold, given to the weight as its `grad_sink`),
never rounded to bf16 on the way. The fp32 path keeps its own tests
(tests/test_tp_parity.py, tests/test_wgrad_fusion.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from bounds import assert_close, within

from helpers import make_ps
from hfmeg.parallel.linear_cross_entropy import linear_cross_entropy

V, H, T = 96, 32, 24
FP32_EPS = torch.finfo(torch.float32).eps
CHUNK = 10  # tokens per chunk of the chunked cross-entropy


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).bfloat16().requires_grad_()
    w = torch.nn.Parameter(torch.randn(V, H, generator=g).bfloat16())
    target = torch.randint(0, V, (T,), generator=g)
    target[3] = -100
    return x, w, target


def _softmax_gradient(x, w, target) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax - onehot in fp32, and its fp32 rounding spread: how far another fp32 formula of it (the
    kernel's exp(z - lse)) can land, absolutely."""
    z = (x.detach() @ w.detach().t()).float()
    p = torch.softmax(z, -1)
    d = p - torch.nn.functional.one_hot(target.clamp_min(0), V).float()
    d[target < 0] = 0
    # exp and the subtraction round within a few ulps; lse's own rounding (|lse| <= max|z| + log V) enters the
    # exponent as an absolute error, i.e. relatively in p.
    spread = p * FP32_EPS * (8 + 2 * (z.abs().max() + math.log(V)))
    return d, torch.where(target[:, None] < 0, 0.0, spread + FP32_EPS * d.abs())


def _reference(x, w, target):
    """fp64 maths on the same bf16 values: the input and weight gradients of `_softmax_gradient` rounded once
    to bf16, as the GEMMs see it."""
    d = _softmax_gradient(x, w, target)[0].bfloat16().double()
    return d @ w.detach().double(), d.t() @ x.detach().double()


def _check_unrounded_weight_gradient(main_grad: torch.Tensor, x, w, target, before: float = 0.0) -> None:
    """`main_grad` (fp32, holding `before` until this backward added the weight gradient) against the float64
    reference, within what the arithmetic allows (see the bound)."""
    d32, spread = _softmax_gradient(x, w, target)
    d = d32.bfloat16().double()
    # The kernel forms the softmax as exp(z - lse), the reference with torch.softmax: within `spread`, which can
    # move a d element that close to a bf16 rounding midpoint to the neighbouring bf16 value (one spacing); the
    # fp32 GEMM sums T exact bf16 x bf16 products (T fp32 eps of their magnitudes). No bf16 rounding of the sum:
    # that would be up to half a bf16 eps of every element, far above this bound where no d element may flip.
    x64 = x.detach().double().abs()
    # Each chunk of CHUNK tokens is added onto what main_grad holds, one rounding of at most an fp32 eps of it.
    want, terms = d.t() @ x.detach().double(), d.abs().t() @ x64
    bound = _bf16_ulp_if_it_may_round_the_other_way(d32, spread).double().t() @ x64 + T * FP32_EPS * terms \
        + math.ceil(T / CHUNK) * FP32_EPS * (abs(before) + terms)
    err = (main_grad.double() - before - want).abs()
    within((err / bound).max().item(), 1.0, "bf16 LM head: fp32 main grad vs float64, per element / its bound")


def _bf16_ulp_if_it_may_round_the_other_way(d32: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
    """Per element, the bf16 spacing where a value `spread` away could round to the neighbouring bf16 value
    (within `spread` of a rounding midpoint), else 0. bf16 keeps 8 significant bits: in [2^(e-1), 2^e) its
    spacing is 2^(e-8), and round-to-nearest switches at the midpoints (k + 1/2) spacings."""
    _, e = torch.frexp(d32)
    ulp = torch.ldexp(torch.ones_like(d32), e - 8)
    r = d32.abs() / ulp
    to_midpoint = ((r - r.floor()) - 0.5).abs() * ulp
    return torch.where(to_midpoint <= spread, ulp, 0.0)


def test_bf16_weight_gradient_lands_unrounded_in_fp32_main_grad():
    ps = make_ps(world=1)
    x, w, target = _inputs()
    main_grad = torch.full((V, H), 0.5)  # what earlier micro-batches left there
    w.grad_sink = main_grad  # as the DP wrapper gives it
    linear_cross_entropy(x, w, target, ps, V, chunk_tokens=CHUNK).sum().backward()
    grad_x, _ = _reference(x, w, target)
    assert w.grad is None  # everything went into main_grad
    _check_unrounded_weight_gradient(main_grad, x, w, target, before=0.5)
    # bf16 output: its own rounding (<= half a bf16 eps = 3.9e-3 relative), the fp32 GEMM's (~V eps32, negligible),
    # and d's rounding to bf16, which an fp32 ulp of difference in the chunked softmax can move by one bf16 ulp
    # for a few terms: rtol 1e-2 ~ 1.3 bf16 eps, atol for outputs near 0 (measured/bound 0.33 on the 2-core VM).
    assert_close(x.grad.double(), grad_x, rtol=1e-2, atol=1e-3)


def test_bf16_weight_without_main_grad_gets_its_gradient_from_autograd():
    ps = make_ps(world=1)
    x, w, target = _inputs()
    linear_cross_entropy(x, w, target, ps, V, chunk_tokens=CHUNK).sum().backward()
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
    linear_cross_entropy(x, w, target, ps, V, chunk_tokens=CHUNK).sum().backward()
    assert w.grad is None
    _check_unrounded_weight_gradient(main_grad, x, w, target)


@pytest.mark.parametrize("chunk", [CHUNK, T])
def test_final_logit_softcap_forward_and_backward_match_autograd(chunk):
    """Gemma's final soft-capping (cap * tanh(z / cap), `softcap`) with padded vocabulary columns: the chunked
    loss and its hand-written backward (softmax - onehot times 1 - tanh²) against float64 autograd through the
    plain formula. fp32 vs float64: every entry is a sum of at most max(H, V) fp32 products/terms, each rounding
    at most one ulp, so within max(H, V)·eps of the magnitude (the standard n·eps bound)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).requires_grad_()
    w = torch.nn.Parameter(torch.randn(V, H, generator=g))
    target = torch.randint(0, V - 16, (T,), generator=g)
    target[5] = -100
    cap, vocab = 3.0, V - 16  # the last 16 rows are padding
    loss = linear_cross_entropy(x, w, target, make_ps(world=1), vocab, chunk_tokens=chunk, softcap=cap)
    gx, gw = torch.autograd.grad(loss.sum(), (x, w))
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    z = torch.tanh((x64 @ w64.t())[:, :vocab] / cap) * cap
    assert (z.abs().max() > cap * 0.95).item()  # the cap bites
    ref = torch.nn.functional.cross_entropy(z, target, ignore_index=-100, reduction="none")
    rx, rw = torch.autograd.grad(ref.sum(), (x64, w64))
    n = max(H, V) * FP32_EPS
    for got, want, name in ((loss, ref, "loss"), (gx, rx, "grad x"), (gw, rw, "grad w")):
        within((got.double() - want).abs().max().item(), n * want.abs().max().item() + 1e-12, name)
    assert torch.equal(gw[vocab:], torch.zeros_like(gw[vocab:]))  # padding rows get no gradient, and no NaN


def _entropy_at_tp(tp: int, cap: float | None, vocab: int):
    """This rank's loss and entropy (and the loss without asking for it) of the module's fp32 case, the vocabulary
    rows split over `tp` gloo ranks."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, H, generator=g)
    w = torch.randn(V, H, generator=g)
    target = torch.randint(0, vocab, (T,), generator=g)
    target[5] = -100
    ps = make_ps(tp=tp)
    rows = w.chunk(tp)[ps.tp_rank]
    loss, entropy = linear_cross_entropy(x, rows, target, ps, vocab, chunk_tokens=CHUNK, softcap=cap, entropy=True)
    plain = linear_cross_entropy(x, rows, target, ps, vocab, chunk_tokens=CHUNK, softcap=cap)
    return loss, entropy, plain


@pytest.mark.parametrize("cap", [None, 3.0], ids=["plain", "softcap"])
def test_entropy_of_the_vocab_parallel_softmax_equals_float64(cap):
    """GRPO's `entropy` metric from the head's own pass: each token's entropy of the softmax over the real
    vocabulary (the 16 padding rows, one rank's, excluded; soft-capped where asked), at TP 1 and 2, against float64;
    the loss is the same bits as without it, an ignored token's entropy is 0.

    Bound: a logit is an H-term fp32 dot product, off by at most dz = H eps max (|x| @ |w|^T); the entropy moves with
    the logits at rate sum_v p_v |log p_v + entropy| <= 2 entropy <= 2 log V, so by 2 log(V) dz; its sums s = sum
    exp(z - m) (positive terms: V eps relative, V eps absolute in log s) and sum exp(z - m)(z - m) over s (V eps of
    max|z - m| <= 2 max|z|); exp, log, tanh and the final division a few eps of max|z| more."""
    from hfmeg.parallel.launch import spawn

    vocab = V - 16
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(T, H, generator=g).double(), torch.randn(V, H, generator=g).double()
    z = (x @ w.t())[:, :vocab]
    z = z if cap is None else torch.tanh(z / cap) * cap
    want = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    want[5] = 0.0
    dz = H * FP32_EPS * float((x.abs() @ w.abs().t()).max())
    zmax = float(z.abs().max())
    bound = 2 * math.log(V) * dz + V * FP32_EPS * (1 + 2 * zmax) + 8 * FP32_EPS * zmax
    for tp in (1, 2):
        for loss, entropy, plain in spawn(_entropy_at_tp, tp, tp, cap, vocab):
            assert torch.equal(loss, plain) and not entropy.requires_grad
            assert entropy[5].item() == 0.0
            within((entropy.double() - want).abs().max().item(), bound, f"entropy at TP{tp}, cap {cap}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_frozen_head_forms_no_weight_gradient_and_the_same_input_gradient(dtype, monkeypatch):
    """LoRA / QLoRA freeze the head: its backward forms no weight gradient (no fp32 [V, h] buffer), and the input
    gradient is bit for bit the one of a trainable head (the same chunks, the same GEMMs)."""
    import hfmeg.parallel.linear_cross_entropy as lce

    x, w, target = _inputs()
    x, w = x.detach().to(dtype).requires_grad_(), torch.nn.Parameter(w.detach().to(dtype))
    ps = make_ps(world=1)
    linear_cross_entropy(x, w, target, ps, V, chunk_tokens=CHUNK).sum().backward()
    trainable = x.grad.clone()
    x.grad, w.grad = None, None
    w.requires_grad_(False)

    def no_weight_gradient(*args):
        raise AssertionError("a weight gradient was formed for a frozen head")

    monkeypatch.setattr(lce, "_add_rows", no_weight_gradient)
    linear_cross_entropy(x, w, target, ps, V, chunk_tokens=CHUNK).sum().backward()
    assert torch.equal(x.grad, trainable) and w.grad is None
