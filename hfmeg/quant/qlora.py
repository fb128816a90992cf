"""QLoRA's frozen base inside a TP linear: the rank's 4-bit codes and absmax, dequantized for each matmul.

A TP column/row-parallel layer obtains the weight for its matmul from its `weight_provider` where it has one
(`parallel/layers.py`); `Frozen4bitWeight` is that provider for a 4-bit base. It holds the rank's share of
bitsandbytes' bytes for the full HF weight (`quant/nf4.py`, cut by `checkpoint/rules_4bit.py`) as buffers, not
parameters: the base is frozen, so the optimizer, the gradient buffers and the checkpoints see only the adapters,
and the layer's full-precision parameter is dropped once the codes are in (`checkpoint/load.py`).

Each forward dequantizes with bitsandbytes' own `dequantize_4bit` and casts to the compute dtype, as
bitsandbytes' `Linear4bit` does before its matmul (`MatMul4Bit`: dequantize in the stored dtype, then `.to` the
input's); the rank's dequantized weight is bit for bit its slice of the full weight's, so the TP collectives
around the matmul are those of the unquantized layer. The dequantized weight is not kept: it is made again in
the backward pass (autograd saves it for the input gradient, and frees it with the graph).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .nf4 import Packed4bit, dequantize


@dataclass(frozen=True)
class Base4bit:
    """How a frozen base is stored: bitsandbytes' `bnb_4bit_quant_type` and `bnb_4bit_use_double_quant`."""

    quant_type: str = "nf4"
    double_quant: bool = True


class Frozen4bitWeight(nn.Module):
    """A weight provider: `()` gives the rank's weight, dequantized from its 4-bit codes, in `dtype`."""

    def __init__(self, packed: Packed4bit, dtype: torch.dtype):
        super().__init__()
        self.quant_type, self.blocksize, self.stored_dtype, self.dtype = (packed.quant_type, packed.blocksize,
                                                                          packed.dtype, dtype)
        # not persistent: a run's checkpoints hold adapters; the base is quantized again from its HF weights.
        # The float32 absmax are held as their int32 bits, so a cast of the model (`.to(bfloat16)`) moves them
        # without rounding them as it would a float buffer (it leaves integer tensors as they are).
        self.register_buffer("codes", packed.codes, persistent=False)
        self.register_buffer("absmax_bits", packed.absmax.float().view(torch.int32), persistent=False)

    def packed(self) -> Packed4bit:
        return Packed4bit(self.codes, self.absmax_bits.view(torch.float32), self.quant_type, self.blocksize,
                          self.stored_dtype)

    def forward(self) -> torch.Tensor:
        return dequantize(self.packed()).to(self.dtype)
