"""Gradient-accumulation fusion: the layers' backward writes weight gradients straight into the fp32 main grad.

This is Megatron's `gradient_accumulation_fusion`. Without it, a linear layer's backward
materialises its weight gradient `g^T x` in the parameter dtype and the DP wrapper's hook
adds that into the fp32 `main_grad`: for a bf16 weight, per element and micro-batch, 2 B
written and read back, 4 B read and 4 B written, and each micro-batch's gradient rounded
to bf16 before it is summed. Here the backward GEMM accumulates into `main_grad` itself
(`addmm` with beta 1, fp32 output from bf16 inputs on CUDA via `out_dtype`); the embedding
does the same with an accumulating `index_put_` (its dense `[V/tp, h]` gradient is never
built; on CUDA that kernel sorts the ids and sums each row's tokens in a fixed order, where
`index_add_`'s atomics would make the sums differ from run to run), and the LM head's
chunked cross-entropy (linear_cross_entropy.py) and the grouped experts
(models/grouped_linear.py) write theirs the same way; the grouped GEMM has no fp32 output for
bf16 inputs in torch 2.13, so an expert's gradient is rounded to bf16 once per micro-batch
before its add.

The main grads are still zeroed once per step (4 B per element, against the 10 B saved per
micro-batch): between steps they are state that others read — PowerSGD keeps its residuals
there and checkpoints save them — so a step's first write overwriting stale values instead
would make that state depend on the step before.

A weight takes part when the DP wrapper (grad_sync.py) has given it a `grad_sink`: the fp32
tensor its gradient is added into (its `main_grad`). The fused backward returns no gradient
for the weight. Autograd still runs the weight's AccumulateGrad node — once per backward,
after every use of the weight, with no gradient — and with it the weight's post-accumulate
hook, which is how the wrapper learns that the weight is done (grad_sync.py; a weight read
twice, like tied embeddings or shared-unlock's shared layers, is announced once, after its
last use, as autograd orders it). A weight without a sink (no DP wrapper: generation, layer
tests; a frozen LoRA base has no gradient at all) takes autograd's ordinary path.

The writes are custom ops that declare the tensor they mutate (`hfmeg::linear_wgrad`,
`hfmeg::embedding_wgrad`), and the sink is an input of the autograd function, so a compiled
decoder layer traces the fused backward into its graph instead of breaking around it.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F


def sink_of(weight: torch.Tensor) -> torch.Tensor | None:
    """The fp32 tensor the weight's gradient is to be added into in this forward, or None."""
    if not (weight.requires_grad and torch.is_grad_enabled()):
        return None
    return getattr(weight, "grad_sink", None)


@cache
def _fp32_accumulating_gemm() -> bool:
    """Whether CUDA `addmm` adds bf16 products into an fp32 `self` (`out_dtype`; torch 2.10 and later:
    earlier ones lack the argument or refuse an fp32 `self` for bf16 matrices). Asked once; the
    refusal is a check before any kernel runs."""
    out, a = torch.zeros(1, 1, device="cuda"), torch.zeros(1, 1, dtype=torch.bfloat16, device="cuda")
    try:
        torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
    except (RuntimeError, TypeError):
        return False
    return True


def add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """`out += a @ b` into fp32 `out`, the product never rounded below fp32 where the kernel allows.

    CUDA GEMMs write fp32 from bf16/fp16 inputs (`out_dtype`); where this torch's cannot add into
    fp32, the product is rounded to the inputs' dtype once and added (the unfused path's rounding).
    CPUs have no such kernel, so there the same low-precision values are multiplied as fp32."""
    if a.dtype != torch.float32:
        if out.is_cuda:
            if _fp32_accumulating_gemm():
                torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
            else:
                out.add_(a @ b)
            return
        a, b = a.float(), b.float()
    out.addmm_(a, b)


@torch.library.custom_op("hfmeg::linear_wgrad", mutates_args=("main_grad",))
def linear_wgrad(main_grad: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> None:
    """`main_grad += g^T x` for `g` `[..., out]`, `x` `[..., in]`."""
    add_product(main_grad, g.reshape(-1, g.shape[-1]).t(), x.reshape(-1, x.shape[-1]))


@linear_wgrad.register_fake
def _(main_grad, g, x) -> None:
    return None


@torch.library.custom_op("hfmeg::embedding_wgrad", mutates_args=("main_grad",))
def embedding_wgrad(main_grad: torch.Tensor, ids: torch.Tensor, g: torch.Tensor) -> None:
    """Row `ids[t]` of `main_grad` += `g[t]`, for every token t (in a fixed order: module doc)."""
    main_grad.index_put_((ids.reshape(-1),), g.reshape(-1, g.shape[-1]).to(main_grad.dtype), accumulate=True)


@embedding_wgrad.register_fake
def _(main_grad, ids, g) -> None:
    return None


class _FusedLinear(torch.autograd.Function):
    """`y = x W^T + b` whose backward adds `g^T x` into W's sink (if it has one) and then returns no W gradient.

    `fp8` (a `quant.fp8_training.Fp8Gemms`, `model.fp8`): the three GEMMs run as its recipe says, on the
    high-precision `x` and `W` saved here (torchao's `Float8Linear` saves them too); the weight gradient it gives
    is added into the sink like any other, so master weights, main grads and the optimizer see no FP8."""

    @staticmethod
    def forward(ctx, x, weight, bias, sink, fp8):
        ctx.save_for_backward(x, weight)
        # Not saved for backward: the sink is written in place by every micro-batch's backward, and a saved
        # tensor's version check would refuse that.
        ctx.sink, ctx.has_bias, ctx.fp8 = sink, bias is not None, fp8
        if fp8 is None:
            return F.linear(x, weight, bias)
        y = fp8.output(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        fp8, grad_x, grad_w = ctx.fp8, None, None
        if ctx.needs_input_grad[0]:
            grad_x = g @ weight if fp8 is None else fp8.grad_input(g.reshape(-1, g.shape[-1]), weight).view(x.shape)
        if fp8 is None:
            linear_wgrad(ctx.sink, g, x)
        elif ctx.sink is not None or ctx.needs_input_grad[1]:
            grad_w = fp8.grad_weight(g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1]))
            if ctx.sink is not None:
                ctx.sink.add_(grad_w)
                grad_w = None
            else:
                grad_w = grad_w.to(weight.dtype)
        grad_b = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, fp8=None) -> torch.Tensor:
    """`F.linear`, with the weight gradient fused into its main grad where the weight has a sink, and its GEMMs in
    FP8 where `fp8` (an `Fp8Gemms`) is given."""
    sink = sink_of(weight)
    if sink is None and fp8 is None:
        return F.linear(x, weight, bias)
    return _FusedLinear.apply(x, weight, bias, sink, fp8)


class _FusedEmbedding(torch.autograd.Function):
    """Row lookup whose backward adds the output gradient's rows into the weight's sink (none into row
    `padding_idx`, as `F.embedding`'s)."""

    @staticmethod
    def forward(ctx, ids, weight, sink, padding_idx):
        ctx.save_for_backward(ids)
        ctx.sink, ctx.padding_idx = sink, padding_idx  # the sink: see _FusedLinear
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        if ctx.padding_idx is not None:
            g = g.masked_fill((ids == ctx.padding_idx).unsqueeze(-1), 0.0)
        embedding_wgrad(ctx.sink, ids, g)
        return None, None, None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """`F.embedding`, with the weight gradient fused into its main grad where the weight has a sink; row
    `padding_idx` (local to `weight`) gets no gradient."""
    sink = sink_of(weight)
    if sink is None:
        return F.embedding(ids, weight, padding_idx)
    return _FusedEmbedding.apply(ids, weight, sink, padding_idx)
