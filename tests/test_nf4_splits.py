"""QLoRA's 4-bit base storage (`hfmeg/quant/nf4.py`), cut per TP rank by each split kind: every rank's dequantized
shard is bit-equal to the same kind's slice of bitsandbytes' dequantization of the full weight, at TP 1, 2 and 4,
NF4 and FP4, with and without double quantization; a split that would cut a quantization block is refused."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as F  # noqa: E402

from hfmeg.errors import UnsupportedConfigError  # noqa: E402
from hfmeg.parallel.splits import COLS, ROWS, Fused, Vocab  # noqa: E402
from hfmeg.quant.nf4 import dequantize, quantize, shard  # noqa: E402

# (kind, weight rows): 256 columns, so a COLS rank holds whole 64-value blocks at TP 4
KINDS = [(ROWS, 96), (COLS, 96), (Fused((64, 16, 16), 4), 96), (Fused((48, 48)), 96), (Vocab(300, 8), 300),
         (Fused((32, 8, 8), 1), 48)]


@pytest.mark.parametrize("kind,rows", KINDS, ids=["rows", "cols", "qkv", "gate_up", "vocab", "qkv_kv_replicated"])
@pytest.mark.parametrize("quant_type,double_quant", [("nf4", True), ("nf4", False), ("fp4", True)])
def test_each_rank_dequantizes_to_its_slice_of_the_full_weight(kind, rows, quant_type, double_quant):
    weight = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    codes, state = F.quantize_4bit(weight, blocksize=64, quant_type=quant_type, compress_statistics=double_quant)
    full = F.dequantize_4bit(codes, state)  # bitsandbytes' own, nested absmax included
    packed = quantize("w", weight, quant_type, double_quant)
    assert torch.equal(packed.codes.flatten(), codes.flatten())  # the bytes bitsandbytes wrote, not others
    for tp in (1, 2, 4):
        for rank in range(tp):
            mine = dequantize(shard("w", packed, kind, tp, rank))
            assert mine.dtype == torch.bfloat16
            assert torch.equal(mine, kind.shard(full, tp, rank)), (tp, rank)


def test_a_split_that_cuts_a_block_is_refused_naming_the_tensor():
    with pytest.raises(UnsupportedConfigError, match=r"^layers.0.attn.out.weight: a rank's 32 columns"):
        shard("layers.0.attn.out.weight", quantize("w", torch.randn(8, 128)), COLS, 4, 0)
    with pytest.raises(UnsupportedConfigError, match=r"^embed.weight: rows of 100 values"):
        quantize("embed.weight", torch.randn(8, 100))
