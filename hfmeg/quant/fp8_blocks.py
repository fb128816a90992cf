"""Block-scaled FP8: how DeepSeek-V3 and Qwen3-FP8 store their linear weights.

A weight W [R, C] is cut into blocks of `block` = (r, c) rows x columns (DeepSeek-V3 and Qwen3: 128 x 128); the
blocks on the bottom and right edges are smaller where r or c does not divide R or C. Each block was scaled into
e4m3's range and rounded: the checkpoint stores the e4m3 values (`float8_e4m3fn`, safetensors `F8_E4M3`) and, per
block, the fp32 factor back, `weight_scale_inv` [ceil(R / r), ceil(C / c)]. So W[i, j] = q[i, j] x
scale_inv[i // r, j // c].

The product is taken in fp32 (e4m3 values are exact there) and rounded once, as transformers' dequantizing load
does; the caller casts it to the dtype it keeps (bf16 for the released models: then it equals transformers'
dequantizing load in bf16, and in fp32 before the cast). Edge blocks follow DeepSeek's definition above;
transformers 5.24 instead divides the dimension evenly by the scale count, which only agrees when r and c divide
R and C (or a dimension has one block).
"""

from __future__ import annotations

import math

import torch


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The `weight_scale_inv` shape of a weight of `shape` ([..., R, C]; leading dims: stacked experts)."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """e4m3 `weight` [..., R, C] times its per-block `scale_inv` -> fp32 [..., R, C]."""
    rows, cols = weight.shape[-2:]
    scale = scale_inv.to(torch.float32)
    scale = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return weight.to(torch.float32) * scale
