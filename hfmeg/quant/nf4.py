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

With double quantization (`double_quant`) bitsandbytes quantizes the absmax too: 8-bit codes, one a block, in
nested blocks of 256 absmax that share one float32 scale, all offset by the weight's mean absmax (`Nested`). They
travel with the absmax, cut by the same split kind, as `index` (each absmax's code plus 256 times its nested block).
A rank keeps them so (`held`: about 1 byte a 64-value block instead of 4) where its absmax fall in whole nested
blocks: every aligned run of 256 of its absmax (the last may be shorter) from one nested block of one HF tensor,
whatever their order inside it, because the nested dequantization is elementwise (`code[q] * scale + offset`), so
bitsandbytes' own `dequantize_blockwise` over the rank's runs gives each absmax the bits it gives it in the whole
tensor. That holds at TP 1 and for whole-row cuts of common shapes; where a cut splits a nested block (a
row-parallel weight's columns, mostly), the rank holds the absmax dequantized (float32).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

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
class Nested:
    """A weight's double-quantized absmax as bitsandbytes stores them, indexed like its absmax (module docstring):
    `index` int32 `[rows, cols / blocksize]` (an absmax's 8-bit code + 256 x its nested block, a row of `scales`),
    `scales` and `offsets` float32 per nested block (its scale; its HF tensor's mean absmax), `code` the 8-bit map,
    `blocksize` absmax a nested block."""

    index: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    code: torch.Tensor
    blocksize: int


@dataclass(frozen=True)
class Packed4bit:
    """A 4-bit weight `[rows, cols]` (or one rank's share of one): codes `[rows, cols / 2]` uint8, absmax
    `[rows, cols / blocksize]` float32 (dequantized where nested), and where double-quantized the `nested` form."""

    codes: torch.Tensor
    absmax: torch.Tensor
    quant_type: str
    blocksize: int
    dtype: torch.dtype  # what dequantization gives
    nested: Nested | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.absmax.shape[0], self.absmax.shape[1] * self.blocksize


@dataclass(frozen=True)
class HeldAbsmax:
    """The absmax a rank holds in nested form (module docstring): `codes` uint8, one an absmax in the rank's order;
    `scales`, `offsets` float32 per run of `blocksize` of them; `code` the 8-bit map."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    code: torch.Tensor
    blocksize: int

    def values(self) -> torch.Tensor:
        """The float32 absmax, as bitsandbytes dequantizes the nested ones of the whole tensor."""
        F = require_bitsandbytes()
        values = F.dequantize_blockwise(self.codes, absmax=self.scales, code=self.code, blocksize=self.blocksize)
        return values + self.offsets.repeat_interleave(self.blocksize)[:values.numel()]


def _runs(nested: Nested) -> torch.Tensor | None:
    """The nested block of each aligned run of `nested.blocksize` of a rank's absmax, or None where a run mixes
    blocks (the rank cannot hold them nested)."""
    block = nested.index.flatten() // 256
    first = block[::nested.blocksize]
    return first if torch.equal(block, first.repeat_interleave(nested.blocksize)[:block.numel()]) else None


def held_absmax(packed: Packed4bit) -> HeldAbsmax | None:
    """`packed`'s absmax in the nested form a rank holds, or None where it holds them float32."""
    runs = None if packed.nested is None else _runs(packed.nested)
    if runs is None:
        return None
    n = packed.nested
    return HeldAbsmax((n.index.flatten() % 256).to(torch.uint8), n.scales[runs], n.offsets[runs], n.code,
                      n.blocksize)


def held_bytes(packed: Packed4bit) -> int:
    """Bytes a rank holds for `packed` (`quant/qlora.py`): the codes (two values a byte, `blocksize / 2` an absmax),
    and the absmax nested (a byte each, two float32 a run, the map) or float32."""
    runs = None if packed.nested is None else _runs(packed.nested)
    absmax = packed.absmax.numel()
    codes = absmax * packed.blocksize // 2
    if runs is None:
        return codes + 4 * absmax
    return codes + absmax + 8 * runs.numel() + 4 * packed.nested.code.numel()


def dequantize_bytes(numel: int, dtype_bytes: int, blocksize: int = 64) -> int:
    """Bytes one dequantization of `numel` values moves: the codes and float32 absmax read, the weight written in a
    `dtype_bytes` dtype."""
    return numel // 2 + numel // blocksize * 4 + numel * dtype_bytes


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
    absmax, nested = state.absmax, None
    if state.nested:
        inner = state.state2
        index = torch.arange(absmax.numel(), dtype=torch.int32) // inner.blocksize * 256 + absmax.int()
        scales = inner.absmax.float()
        nested = Nested(index.view(rows, -1), scales, state.offset.float().expand(scales.numel()), inner.code.float(),
                        inner.blocksize)
        absmax = F.dequantize_blockwise(absmax, inner) + state.offset
    return Packed4bit(codes.view(rows, cols // 2), absmax.float().view(rows, cols // state.blocksize),
                      state.quant_type, state.blocksize, state.dtype, nested)


def joined(parts: list[Packed4bit], in_order: Callable[[list[torch.Tensor]], torch.Tensor]) -> Packed4bit:
    """One 4-bit weight of `parts` (each quantized alone, of one quant type and block size), their rows put in order
    by `in_order` (a fused weight's layout); nested absmax kept where every part has them in one map and nested block
    size, each part's nested blocks numbered after the previous parts'."""
    nested = None
    inner = [p.nested for p in parts]
    if all(n is not None and n.blocksize == inner[0].blocksize and torch.equal(n.code, inner[0].code) for n in inner):
        starts = [0]
        for n in inner[:-1]:
            starts.append(starts[-1] + n.scales.numel())
        nested = Nested(in_order([n.index + 256 * s for n, s in zip(inner, starts)]),
                        torch.cat([n.scales for n in inner]), torch.cat([n.offsets for n in inner]), inner[0].code,
                        inner[0].blocksize)
    first = parts[0]
    return Packed4bit(in_order([p.codes for p in parts]), in_order([p.absmax for p in parts]), first.quant_type,
                      first.blocksize, first.dtype, nested)


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
    nested = packed.nested
    if nested is not None:
        nested = replace(nested, index=split.shard(nested.index, parts, index).contiguous())
    return replace(packed, codes=split.shard(packed.codes, parts, index).contiguous(),
                   absmax=split.shard(packed.absmax, parts, index).contiguous(), nested=nested)


def piece(packed: Packed4bit, dim: int, lo: int, hi: int) -> Packed4bit:
    """Rows (`dim` 0) or columns (`dim` 1, `lo` and `hi` multiples of the block size) `lo:hi` of `packed`: their
    codes and absmax, so that its dequantization is that slice of `packed`'s, bit for bit (each value is its code
    times its block's absmax, and the cut keeps blocks whole); the nested form is not carried."""
    if dim == 0:
        return replace(packed, codes=packed.codes[lo:hi], absmax=packed.absmax[lo:hi], nested=None)
    if lo % packed.blocksize or hi % packed.blocksize:
        raise ValueError(f"columns {lo}:{hi} cut a {packed.blocksize}-value block")
    return replace(packed, codes=packed.codes[:, lo // 2:hi // 2].contiguous(),
                   absmax=packed.absmax[:, lo // packed.blocksize:hi // packed.blocksize].contiguous(), nested=None)


def dequantize(packed: Packed4bit) -> torch.Tensor:
    """The weight `packed` holds, by bitsandbytes' own dequantization."""
    F = require_bitsandbytes()
    rows, cols = packed.shape
    state = F.QuantState(absmax=packed.absmax.flatten(), shape=torch.Size((rows, cols)),
                         code=F.get_4bit_type(packed.quant_type, device=packed.codes.device),
                         blocksize=packed.blocksize, quant_type=packed.quant_type, dtype=packed.dtype)
    return F.dequantize_4bit(packed.codes.reshape(-1, 1), state)
