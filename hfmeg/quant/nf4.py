"""A 4-bit (NF4 / FP4) base weight as bitsandbytes stores it, cut per rank by the weight's own split kind.

QLoRA's base is the bytes bitsandbytes produces for the full weight: `quantize_4bit` over the flattened
weight, `blocksize` consecutive values sharing one absmax, two 4-bit codes a byte. The full weight is quantized
once; each rank's share is then cut from those bytes, never re-quantized, so each rank's dequantized shard is
exactly the slice of the dequantized full weight (a rank that re-quantized its own slice would get other blocks,
other absmax and other values).

Cutting works because a block never spans two rows when the row length is a multiple of `blocksize`: the codes
are then a `[rows, cols / 2]` byte matrix and the absmax a `[rows, cols / blocksize]` one, each row of both
belonging to one row of the weight. Any split kind that moves whole rows (`parallel/splits.py`: `ROWS`, the fused
QKV and gate/up layouts, the padded vocabulary) applies to them unchanged; one that splits the columns (`COLS`)
does too where each rank's columns are whole blocks. Where a split would cut a block (a row length, or a rank's
share of it, not a multiple of `blocksize`) the weight is refused in one line naming it; padding was not chosen,
because a padded block would have another absmax than bitsandbytes gives the unpadded weight.

With double quantization (`double_quant`) bitsandbytes quantizes the absmax too (8-bit, in blocks of 256 absmax,
offset by their mean). A rank's absmax are not whole blocks of 256 in general, so each rank holds them dequantized
(float32, the values bitsandbytes' own dequantization computes from the nested ones), which keeps the weights
bit-exact at 4 bytes per block instead of about one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..errors import UnsupportedConfigError

QUANT_TYPES = ("nf4", "fp4")
# Values quantized by one call. bitsandbytes' CPU `quantize_4bit` holds about 16 bytes a value in temporaries
# (float32 copies, int32 codes): for a 7B MLP weight (45M values) 0.7 GB above the run's resident base. Its blocks
# never span rows here (`_whole_blocks`), so the weight is quantized a few rows at a time to the same codes and
# absmax, and the double quantization, which needs the whole weight's absmax (their mean is its offset), is done
# once on them as `quantize_4bit` does it.
QUANTIZE_VALUES = 1 << 21


def require_bitsandbytes(needed_by: str = "peft.quantize"):
    """bitsandbytes.functional, or one line saying what `needed_by` needs installed."""
    try:
        import bitsandbytes.functional as F
    except ImportError:
        raise UnsupportedConfigError(f"{needed_by} needs bitsandbytes: pip install 'bitsandbytes>=0.50'") from None
    return F


@dataclass(frozen=True)
class Packed4bit:
    """A 4-bit weight `[rows, cols]` (or one rank's share of one): codes `[rows, cols / 2]` uint8, absmax
    `[rows, cols / blocksize]` float32."""

    codes: torch.Tensor
    absmax: torch.Tensor
    quant_type: str
    blocksize: int
    dtype: torch.dtype  # what dequantization gives

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 2


def stored_bytes(numel: int, blocksize: int = 64) -> int:
    """Bytes a rank holds for `numel` values of a 4-bit weight (`Packed4bit`): the codes (two a byte) and one
    float32 absmax a block (double-quantized absmax are held dequantized, module docstring)."""
    return numel // 2 + numel // blocksize * 4


def dequantize_bytes(numel: int, dtype_bytes: int, blocksize: int = 64) -> int:
    """Bytes one dequantization of `numel` values moves: the codes and absmax read, the weight written in a
    `dtype_bytes` dtype."""
    return stored_bytes(numel, blocksize) + numel * dtype_bytes


def quantize(name: str, weight: torch.Tensor, quant_type: str = "nf4", double_quant: bool = True,
             blocksize: int = 64) -> Packed4bit:
    """bitsandbytes' 4-bit quantization of the full 2-d `weight` (named `name` in a refusal)."""
    if quant_type not in QUANT_TYPES:
        raise UnsupportedConfigError(f"peft.quantize: {quant_type!r} is not one of {QUANT_TYPES}")
    rows, cols = weight.shape
    _whole_blocks(name, cols, blocksize)
    F = require_bitsandbytes()
    step = max(1, QUANTIZE_VALUES // cols)
    pieces = [F.quantize_4bit(weight[i:i + step], blocksize=blocksize, quant_type=quant_type,
                              compress_statistics=False) for i in range(0, rows, step)]
    codes, absmax = torch.cat([c.view(-1) for c, _ in pieces]), torch.cat([s.absmax for _, s in pieces])
    offset = state2 = None
    if double_quant:  # what `quantize_4bit(compress_statistics=True)` does with the whole weight's absmax
        offset = absmax.mean()
        absmax, state2 = F.quantize_blockwise(absmax - offset, blocksize=256)
    state = F.QuantState(absmax=absmax, shape=weight.shape, code=pieces[0][1].code, blocksize=blocksize,
                         quant_type=quant_type, dtype=weight.dtype, offset=offset, state2=state2)
    return from_quant_state(name, codes, state)


def from_quant_state(name: str, codes: torch.Tensor, state) -> Packed4bit:
    """The `Packed4bit` of bitsandbytes' `codes` and `QuantState` `state` for a 2-d weight (just quantized, or as a
    `*-bnb-4bit` checkpoint stores it): the codes as they are, the absmax dequantized where nested."""
    rows, cols = state.shape
    _whole_blocks(name, cols, state.blocksize)
    F = require_bitsandbytes()
    absmax = state.absmax
    if state.nested:
        absmax = F.dequantize_blockwise(absmax, state.state2) + state.offset
    return Packed4bit(codes.view(rows, cols // 2), absmax.float().view(rows, cols // state.blocksize),
                      state.quant_type, state.blocksize, state.dtype)


def _whole_blocks(name: str, cols: int, blocksize: int) -> None:
    if cols % blocksize:
        raise UnsupportedConfigError(f"{name}: rows of {cols} values are not whole {blocksize}-value quantization "
                                     "blocks; a block would span two rows, which no split can cut")


def shard(name: str, packed: Packed4bit, split, parts: int, index: int) -> Packed4bit:
    """Piece `index` of `parts` of `packed`, cut by the weight's split kind `split` (rows whole, or columns in
    whole blocks)."""
    if split.tp_dim == 1 and packed.shape[1] // parts % packed.blocksize:
        raise UnsupportedConfigError(f"{name}: a rank's {packed.shape[1] // parts} columns are not whole "
                                     f"{packed.blocksize}-value quantization blocks; use a TP size that keeps them "
                                     "whole")
    return replace(packed, codes=split.shard(packed.codes, parts, index).contiguous(),
                   absmax=split.shard(packed.absmax, parts, index).contiguous())


def dequantize(packed: Packed4bit) -> torch.Tensor:
    """The weight `packed` holds, by bitsandbytes' own dequantization."""
    F = require_bitsandbytes()
    rows, cols = packed.shape
    state = F.QuantState(absmax=packed.absmax.flatten(), shape=torch.Size((rows, cols)),
                         code=F.get_4bit_type(packed.quant_type, device=packed.codes.device),
                         blocksize=packed.blocksize, quant_type=packed.quant_type, dtype=packed.dtype)
    return F.dequantize_4bit(packed.codes.reshape(-1, 1), state)
