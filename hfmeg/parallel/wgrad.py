"""Gradient-accumulation fusion: the layers' backward writes weight gradients straight into the fp32 main grad.

This is Megatron's `gradient_accumulation_fusion`. Without it, a linear layer's backward
materialises its weight gradient `g^T x` in the parameter dtype and the DP wrapper's hook
adds that into the fp32 `main_grad`: for a bf16 weight, per element and micro-batch, 2 B
written and read back, 4 B read and 4 B written, and each micro-batch's gradient rounded
to bf16 before it is summed. Here the backward GEMM accumulates into `main_grad` itself
(`addmm` with beta 1, fp32 output from bf16 inputs on CUDA via `out_dtype`); the embedding
does the same with `index_add_` (its dense `[V/tp, h]` gradient is never built), and the LM
head's chunked cross-entropy (linear_cross_entropy.py) writes its products the same way.

The main grads are still zeroed once per step (4 B per element, against the 10 B saved per
micro-batch): between steps they are state that others read — PowerSGD keeps its residuals
there and checkpoints save them — so a step's first write overwriting stale values instead
would make that state depend on the step before.

A weight takes part by having a `GradSink` (attribute `grad_sink`), which the DP wrapper
(grad_sync.py) gives every parameter it buffers. The fused backward returns no gradient
for the weight and calls `GradSink.landed()`, the wrapper's bucket accounting for that
weight (torch still runs the weight's post-accumulate hook, with no gradient; the wrapper
ignores that call, `GradSink.announced`). A weight without a sink (no DP wrapper: generation, layer tests; a frozen
LoRA base has no gradient at all) takes autograd's ordinary path.

A weight several modules hold (shared-unlock's shared layers, models/shared_layers.py) is
written once per module in a backward; its sink counts the writes (`uses`) and the weight is
announced once, after the last, so its bucket is never reduced before every use has added
to it. The tied embedding and LM head on one stage share a weight through a function call,
not a module attribute, so no count sees it: those layers pass `fuse=False` and stay on
autograd's path, which sums both uses before its one AccumulateGrad.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(eq=False)
class GradSink:
    """Where a fused backward puts one weight's gradient.

    `uses`: fused writes per backward (the modules holding the weight); `landed` announces the
    weight at the last of them. `written`, `announced`: the DP wrapper's bookkeeping (the
    writes so far; announced, and autograd's own hook for the weight not run yet)."""

    main_grad: torch.Tensor
    landed: Callable[[], None]
    uses: int = 1
    written: int = 0
    announced: bool = False


def sink_of(weight: torch.Tensor, fuse: bool = True) -> GradSink | None:
    """The weight's sink when its gradient is to be fused in this forward, else None."""
    if not (fuse and weight.requires_grad and torch.is_grad_enabled()):
        return None
    return getattr(weight, "grad_sink", None)


def add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """`out += a @ b` into fp32 `out`, the product never rounded below fp32.

    CUDA GEMMs write fp32 from bf16/fp16 inputs (`out_dtype`); CPUs have no such kernel,
    so there the same low-precision values are multiplied as fp32."""
    if a.dtype != torch.float32:
        if out.is_cuda:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
            return
        a, b = a.float(), b.float()
    out.addmm_(a, b)


class _FusedLinear(torch.autograd.Function):
    """`y = x W^T + b` whose backward adds `g^T x` into W's main grad and returns no W gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, sink):
        ctx.save_for_backward(x, weight)
        ctx.sink, ctx.has_bias = sink, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        grad_x = g @ weight if ctx.needs_input_grad[0] else None
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        add_product(ctx.sink.main_grad, g2.t(), x2)
        ctx.sink.landed()
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_b, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, fuse: bool = True) -> torch.Tensor:
    """`F.linear`, with the weight gradient fused into its main grad where the weight has a sink."""
    sink = sink_of(weight, fuse)
    if sink is None:
        return F.linear(x, weight, bias)
    return _FusedLinear.apply(x, weight, bias, sink)


class _FusedEmbedding(torch.autograd.Function):
    """Row lookup whose backward `index_add_`s the output gradient's rows into the weight's main grad."""

    @staticmethod
    def forward(ctx, ids, weight, sink):
        ctx.save_for_backward(ids)
        ctx.sink = sink
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        main = ctx.sink.main_grad
        main.index_add_(0, ids.reshape(-1), g.reshape(-1, g.shape[-1]).to(main.dtype))
        ctx.sink.landed()
        return None, None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor, fuse: bool = True) -> torch.Tensor:
    """`F.embedding`, with the weight gradient fused into its main grad where the weight has a sink."""
    sink = sink_of(weight, fuse)
    if sink is None:
        return F.embedding(ids, weight)
    return _FusedEmbedding.apply(ids, weight, sink)
