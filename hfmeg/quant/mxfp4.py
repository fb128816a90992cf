"""MXFP4 (OCP microscaling, 4-bit): how gpt-oss stores its experts.

A block of 32 consecutive values along a row shares one scale. Each value is an e2m1 float in 4 bits (sign, 2
exponent bits, 1 mantissa bit: the 16 codes are ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}); two values fill a byte, the first
in the low nibble. The block's scale is an e8m0 byte s, the power of two 2^(s - 127). So a row of K values is
stored as K / 32 blocks of 16 bytes (`*_blocks`, uint8 [..., K / 32, 16]) and K / 32 scale bytes (`*_scales`,
uint8 [..., K / 32]), and value j of block b is e2m1(nibble j of block b) x 2^(scale_b - 127).

Every e2m1 value times a power of two is exact in bf16 (and fp32), so dequantizing loses nothing: the values are
looked up in the target dtype and scaled with `ldexp`, the same operations transformers' dequantizing load does.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per scale
BLOCK_BYTES = BLOCK // 2
E8M0_BIAS = 127
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # by 4-bit code


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., G, 16] uint8 blocks and [..., G] uint8 scales -> [..., G * 32] values in `dtype`.

    Works one leading index at a time (an expert of a stacked tensor), so the temporaries stay the size of one
    expert's matrix; the caller has checked the shapes (`checkpoint/quantized.py`)."""
    lead = blocks.shape[:-2]
    out = torch.empty(*lead, blocks.shape[-2] * BLOCK, dtype=dtype)
    lut = torch.tensor(E2M1, dtype=dtype)
    flat_blocks, flat_scales, flat_out = blocks.reshape(-1, *blocks.shape[-2:]), scales.reshape(-1, scales.shape[-1]), \
        out.view(-1, blocks.shape[-2], BLOCK)
    for i in range(flat_blocks.shape[0]):
        b = flat_blocks[i]
        values = torch.stack([lut[(b & 0x0F).long()], lut[(b >> 4).long()]], dim=-1).flatten(-2)  # low nibble first
        exponent = flat_scales[i].to(torch.int32).sub(E8M0_BIAS).unsqueeze(-1)
        flat_out[i] = torch.ldexp(values, exponent).to(dtype)
    return out
