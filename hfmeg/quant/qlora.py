"""QLoRA's frozen base inside a TP linear: the rank's 4-bit codes and absmax, dequantized for each matmul.

A TP column/row-parallel layer obtains the weight for its matmul from its `weight_provider` where it has one
(`parallel/layers.py`); `Frozen4bitWeight` is that provider for a 4-bit base. It holds the rank's share of
bitsandbytes' bytes for the full HF weight (`quant/nf4.py`, cut by `checkpoint/rules_4bit.py`) as buffers, not
parameters: the base is frozen, so the optimizer, the gradient buffers and the checkpoints see only the adapters,
and the layer's full-precision parameter is dropped once the codes are in (`checkpoint/load.py`).

Each forward dequantizes with bitsandbytes' own `dequantize_4bit` and casts to the compute dtype, as
bitsandbytes' `Linear4bit` does before its matmul (`MatMul4Bit`: dequantize in the stored dtype, then `.to` the
input's); the rank's dequantized weight is bit for bit its slice of the full weight's, so the TP collectives
around the matmul are those of the unquantized layer. The matmul (`linear`) does not keep the dequantized weight
for backward, where the input gradient needs it: it keeps the provider and dequantizes again there, as
bitsandbytes' `MatMul4Bit` does. (`F.linear` would keep every layer's full-precision weight from its forward to
its backward, i.e. the whole stage's unquantized base per micro-batch in flight.)

Nor does it dequantize the whole weight at once where it is larger than `PIECE_BYTES`: the forward's `x W^T` is
computed a piece of W's rows (output features) at a time and the backward's `g W` a piece of its columns (input
features, in whole 64-value blocks), each piece dequantized from its own codes and absmax (`nf4.piece`: bit for bit
that slice of the whole weight's). Both cut the output features of their product, never the sum over the other
dimension, so each output value is the same dot product as with the whole weight. At a 7B's shapes the fused
gate/up weight (22016 x 4096) was 172 MiB in bf16, in flight twice a step per layer: the largest block of a QLoRA
step's peak memory above the held base (docs/peft.md, "QLoRA memory vs LoRA"). The layer hands the whole weight
only to an adapter that reads it (DoRA's row norms, `LoraAdapter.reads_weight`).

A rank's routed experts of an MoE layer are one provider per stacked weight (`experts`: how many it holds), whose
`()` is the stack `[E_local, out, in]`; their grouped GEMM dequantizes again in backward the same way
(`models/grouped_linear.py`, its `provider`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .nf4 import HeldAbsmax, Packed4bit, dequantize, held_absmax, piece


# The most bytes of a 2-d weight dequantized at once by its matmuls (module docstring): small next to a 7B layer's
# weights (32-172 MiB in bf16), large enough that each piece is still one big GEMM.
PIECE_BYTES = 32 << 20


@dataclass(frozen=True)
class Base4bit:
    """How a frozen base is stored: bitsandbytes' `bnb_4bit_quant_type` and `bnb_4bit_use_double_quant`."""

    quant_type: str = "nf4"
    double_quant: bool = True


class Frozen4bitWeight(nn.Module):
    """A weight provider: `()` gives the rank's weight, dequantized from its 4-bit codes, in `dtype`; with
    `experts`, the codes' rows are that many experts' weights and `()` gives them stacked `[experts, out, in]`."""

    def __init__(self, packed: Packed4bit, dtype: torch.dtype, experts: int | None = None):
        super().__init__()
        self.quant_type, self.blocksize, self.stored_dtype, self.dtype = (packed.quant_type, packed.blocksize,
                                                                          packed.dtype, dtype)
        self.experts = experts
        # not persistent: a run's checkpoints hold adapters; the base is quantized again from its HF weights.
        # The absmax are held nested where the rank's are whole nested blocks (`nf4.held_absmax`), else float32.
        # Float buffers are held as their int32 bits, so a cast of the model (`.to(bfloat16)`) moves them without
        # rounding them as it would a float buffer (it leaves integer tensors as they are).
        self.register_buffer("codes", packed.codes, persistent=False)
        held = held_absmax(packed)
        self.absmax_shape, self.nested_blocksize = packed.absmax.shape, None if held is None else held.blocksize
        if held is None:
            self.register_buffer("absmax_bits", _bits(packed.absmax), persistent=False)
        else:
            self.register_buffer("absmax_codes", held.codes, persistent=False)
            for name in ("scales", "offsets", "code"):
                self.register_buffer(f"absmax_{name}_bits", _bits(getattr(held, name)), persistent=False)

    def absmax(self) -> torch.Tensor:
        """The rank's float32 absmax, `[rows, cols / blocksize]`."""
        if self.nested_blocksize is None:
            return self.absmax_bits.view(torch.float32)
        held = HeldAbsmax(self.absmax_codes, *(getattr(self, f"absmax_{name}_bits").view(torch.float32)
                                               for name in ("scales", "offsets", "code")), self.nested_blocksize)
        return held.values().view(self.absmax_shape)

    def packed(self) -> Packed4bit:
        return Packed4bit(self.codes, self.absmax(), self.quant_type, self.blocksize, self.stored_dtype)

    @property
    def shape(self) -> torch.Size:
        """`()`'s shape, known without dequantizing (`parallel/layers.py`, `matmul_shape`)."""
        rows, cols = self.codes.shape[0], self.codes.shape[1] * 2
        return torch.Size((rows, cols) if self.experts is None else (self.experts, rows // self.experts, cols))

    def forward(self) -> torch.Tensor:
        weight = dequantize(self.packed()).to(self.dtype)
        return weight if self.experts is None else weight.unflatten(0, (self.experts, -1))

    def linear(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x W^T + bias` for W = `self()`; `weight` is W where the caller holds it already, else None (the
        forward dequantizes it in pieces); the backward dequantizes W again, in pieces (module doc)."""
        return _Dequantized.apply(x, weight, bias, self)

    def _pieces(self, dim: int) -> list[tuple[int, int]] | None:
        """The `(lo, hi)` ranges of W's rows (`dim` 0) or whole-block columns (`dim` 1) dequantized at a time so that
        a piece is at most `PIECE_BYTES` (or one block wide), or None where W is that small whole."""
        rows, cols = self.shape
        itemsize = self.dtype.itemsize
        if rows * cols * itemsize <= PIECE_BYTES:
            return None
        unit = 1 if dim == 0 else self.blocksize
        step = max(1, PIECE_BYTES // (itemsize * (cols if dim == 0 else rows) * unit)) * unit
        size = rows if dim == 0 else cols
        return [(lo, min(lo + step, size)) for lo in range(0, size, step)]

    def product(self, a: torch.Tensor, bias: torch.Tensor | None = None, *, transposed: bool) -> torch.Tensor:
        """`a W^T + bias` (`transposed`: the forward's), else `a W` (the backward's), W dequantized a piece of the
        product's output features at a time (module docstring)."""
        dim = 0 if transposed else 1
        pieces = self._pieces(dim)
        if pieces is None:
            return F.linear(a, self(), bias) if transposed else a @ self()
        packed = self.packed()
        out = a.new_empty(*a.shape[:-1], self.shape[dim])
        for lo, hi in pieces:
            w = dequantize(piece(packed, dim, lo, hi)).to(self.dtype)
            out[..., lo:hi] = F.linear(a, w, None if bias is None else bias[lo:hi]) if transposed else a @ w
        return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous().view(torch.int32)


class _Dequantized(torch.autograd.Function):
    """`y = x W^T + b` with W frozen: backward's `g W` dequantizes W again instead of having kept it."""

    @staticmethod
    def forward(ctx, x, weight, bias, provider):
        ctx.provider, ctx.has_bias = provider, bias is not None
        return provider.product(x, bias, transposed=True) if weight is None else F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        grad_bias = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_x = ctx.provider.product(g, transposed=False) if ctx.needs_input_grad[0] else None
        return grad_x, None, grad_bias, None
