"""Grouped linear: rows in contiguous groups, each group times its own weight, forward and backward as grouped GEMMs.

The routed experts of a MoE layer (`models/moe.py`) are one stacked weight `w`
`[G, N, K]` and the token rows `x` `[R, K]` sorted by expert, group g being rows
`[offs[g-1], offs[g])` (`offs` `[G]` int32, the running ends, on the device). Then

    forward   y_g  = x_g w_g^T        `_grouped_mm(x, w^T)`     [R, N]
    input     dx_g = dy_g w_g         `_grouped_mm(dy, w)`      [R, K]
    weight    dw_g = dy_g^T x_g       `_grouped_mm(dy^T, x)`    [G, N, K]  (offsets along the reduced dim)

so one kernel launch covers every expert, whatever their row counts, and the offsets never
leave the device. torch's own autograd for `_grouped_mm` cannot do the weight gradient on
CPU for these layouts, so `GroupedLinear` states the three products itself. An empty group
gives zero rows and a zero weight gradient, so every expert's weight gets a gradient in
every backward (the data-parallel hooks fire alike on every rank).

A frozen weight held another way (QLoRA's 4-bit experts, `quant/qlora.py`) comes with its `provider`, whose `()`
gives `w` again: the backward's input gradient asks it for the weight instead of keeping `w` from the forward (as
bitsandbytes' 4-bit matmul dequantizes again in backward), so no layer's dequantized stack lives from its forward
to its backward.

The weight gradient is formed in one place, `expert_wgrad`. It asks the kernel for an fp32
result where the kernel offers one (`_fp32_wgrad`; torch 2.13 offers it only for fp32
inputs). Where the weight has a sink, its fp32 main grad (gradient-accumulation fusion,
parallel/wgrad.py), it is added there and autograd gets no weight gradient; otherwise it
is cast to the weight's dtype as autograd expects.

Fallback: `_grouped_mm` needs every operand's non-unit stride to be a multiple of 16
bytes (and on GPUs a 16-byte aligned start), e.g. K and N multiples of 4 in fp32, 8 in
bf16; and it takes fp32, bf16 and fp16 only. Where an operand does not fit (the tiny test
models' odd sizes, the float64 reference runs of the tests), the same products run
as a loop of `mm` over the same groups; that loop reads the offsets on the host, which
costs nothing on CPU but is a device sync on a GPU. torch's CUDA kernel itself takes
bf16 on sm90+; other dtypes run torch's per-group fallback, which also reads the offsets
on the host.
"""

from __future__ import annotations

from functools import cache

import torch

from ..parallel.wgrad import sink_of

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what `_grouped_mm` takes


def _fits(t: torch.Tensor) -> bool:
    """Whether `_grouped_mm` takes `t`: a dtype it has, one of its last two dims unit-strided, the other's
    stride a multiple of 16 bytes, and on GPUs a start aligned to 16 bytes."""
    inner, outer = t.stride()[-1], t.stride()[-2]
    stride = outer if inner == 1 else inner if outer == 1 else None
    return (t.dtype in _DTYPES and stride is not None and stride * t.element_size() % 16 == 0
            and (t.is_cpu or t.data_ptr() % 16 == 0))


def _starts_ends(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()  # the fallback's host read (see the module docstring)
    return list(zip([0] + ends[:-1], ends))


def grouped_rows(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`[R, N]`: group g of the rows of `a` `[R, K]` times `b[g]` `[K, N]`."""
    if _fits(a) and _fits(b):
        return torch._grouped_mm(a, b, offs=offs)
    return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(_starts_ends(offs))])


@cache
def _fp32_wgrad(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `_grouped_mm` on `device_type` gives an fp32 result for `dtype` inputs (asked once; the
    refusal is a check before any kernel runs)."""
    if dtype == torch.float32:
        return True
    a = torch.zeros(8, 8, dtype=dtype, device=device_type)
    try:
        torch._grouped_mm(a.t(), a, offs=torch.full((1,), 8, dtype=torch.int32, device=device_type),
                          out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


def expert_wgrad(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The weight gradient `[G, N, K]`, fp32 where the kernel offers it: `dy_g^T x_g` for group g of the
    rows of `dy` `[R, N]` and `x` `[R, K]`."""
    a = dy.t()
    if _fits(a) and _fits(x):
        out = torch.float32 if _fp32_wgrad(x.device.type, x.dtype) else None
        return torch._grouped_mm(a, x, offs=offs, out_dtype=out)
    return torch.stack([a[:, s:e] @ x[s:e] for s, e in _starts_ends(offs)])


class GroupedLinear(torch.autograd.Function):
    """`y` `[R, N]` with `y_g = x_g w_g^T`: rows `x` `[R, K]` grouped by `offs`, stacked weight `w` `[G, N, K]`.

    `fp8` (an `Fp8Gemms`, `model.fp8`): each group runs as its own FP8 linear, its scales taken over its own rows
    and its own weight `w_g`, as torchao's recipe would scale an `nn.Linear` per expert. torchao's FP8 grouped
    GEMM (`prototype.moe_training`) is rowwise-only, CUDA/Triton-only and has no emulation; so here the groups
    run one after another through `Fp8Gemms` (torchao's scaled GEMM, emulated off FP8 hardware), reading the
    offsets on the host like the fallback above."""

    @staticmethod
    def forward(ctx, x, w, offs, sink, fp8, provider):
        x = x.contiguous()
        ctx.save_for_backward(x, w if provider is None else None, offs)
        ctx.sink, ctx.fp8, ctx.provider = sink, fp8, provider
        if fp8 is not None:
            return _per_group(offs, x.new_empty(0, w.shape[1]), lambda g, s, e: fp8.output(x[s:e], w[g]))
        return grouped_rows(x, w.transpose(1, 2), offs)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w, offs = ctx.saved_tensors
        fp8 = ctx.fp8
        if ctx.provider is not None:  # frozen: the input gradient only, from the weight given again
            dx = grouped_rows(dy.contiguous(), ctx.provider(), offs) if ctx.needs_input_grad[0] else None
            return dx, None, None, None, None, None
        dy = dy.contiguous()  # autograd may hand over an expanded (zero-stride) gradient
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = (grouped_rows(dy, w, offs) if fp8 is None else
                  _per_group(offs, x.new_empty(0, w.shape[2]), lambda g, s, e: fp8.grad_input(dy[s:e], w[g])))
        if ctx.sink is None and not ctx.needs_input_grad[1]:
            return dx, None, None, None, None, None
        if fp8 is None:
            wgrad = expert_wgrad(dy, x, offs)
        else:
            wgrad = torch.stack([fp8.grad_weight(dy[s:e], x[s:e]) for s, e in _starts_ends(offs)])
        if ctx.sink is not None:
            ctx.sink.add_(wgrad)
        else:
            dw = wgrad.to(w.dtype)
        return dx, dw, None, None, None, None


def _per_group(offs: torch.Tensor, empty: torch.Tensor, gemm) -> torch.Tensor:
    """The rows of every group's `gemm(g, start, end)`, concatenated (`empty`: the result without groups)."""
    return torch.cat([empty] + [gemm(g, s, e) for g, (s, e) in enumerate(_starts_ends(offs))])


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, fp8=None, provider=None) -> torch.Tensor:
    """`GroupedLinear`, the weight gradient fused into `w`'s main grad where it has a sink; `fp8`: an `Fp8Gemms`;
    `provider`: the frozen `w`'s provider (module docstring)."""
    return GroupedLinear.apply(x, w, offs, None if provider is not None else sink_of(w), fp8, provider)
