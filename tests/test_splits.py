"""Split kinds (`hfmeg/parallel/splits.py`): every kind gives back every bit through shard -> join at 1, 2 and 4
pieces, its `full_shape` inverts each piece's shape and `local_shape` gives it, and its adapter-file `record` names a
kind that joins alike.
Adding a kind is one class there and one case in `CASES` here (a test fails for a kind without one)."""

from __future__ import annotations

import inspect

import pytest
import torch

from hfmeg.parallel import splits
from hfmeg.parallel.splits import (COLS, EXPERT_COLS, EXPERT_ROWS, EXPERTS, REPLICATED, ROWS, Blocks, Fused, Split,
                                   Vocab, from_record)

# (kind, full shape): the shapes divide as each kind needs at 1, 2 and 4 pieces
CASES = [
    (REPLICATED, (6, 5)),
    (ROWS, (8, 3)),
    (COLS, (3, 8)),
    (EXPERT_ROWS, (16, 5)),
    (EXPERT_COLS, (5, 12)),
    (EXPERTS, (4, 6, 3)),  # 4 experts of [6, 3]: whole experts per piece
    (Vocab(301, 8), (301, 4)),  # padded to 304 / 304 / 320 rows at 1 / 2 / 4 pieces
    (Fused((16, 8)), (24, 3)),  # gate/up: one block per piece
    (Fused((16, 4, 4), 4), (24, 3)),  # QKV of 4 KV groups: whole groups per piece
    (Fused((8, 2, 2), 1), (12, 3)),  # QKV of 1 KV group: replicated over 2 and 4 pieces
    (Fused((16, 8), 2), (24,)),  # keys as values, 2 groups: replicated over 4 pieces (a 1-d bias)
    (Fused((2,), 1, 0), (2, 3)),  # k_proj's LoRA B of 1 KV group: a copy on every piece
    (Fused((4, 4), 2, 0), (8, 3)),  # k and v of 2 groups: whole groups on 2 pieces, copies on 4
]


def test_every_kind_has_a_case():
    kinds = {c for _, c in inspect.getmembers(splits, inspect.isclass) if issubclass(c, Split) and c is not Split}
    assert kinds == {type(kind) for kind, _ in CASES}


@pytest.mark.parametrize("kind,shape", CASES, ids=[f"{type(k).__name__}{i}" for i, (k, _) in enumerate(CASES)])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_shard_join_round_trip_and_full_shape(kind, shape, n):
    full = torch.randn(shape, generator=torch.Generator().manual_seed(n))
    pieces = [kind.shard(full, n, i) for i in range(n)]
    assert len({p.shape for p in pieces}) == 1
    assert torch.equal(kind.join(pieces), full)
    assert all(kind.full_shape(tuple(p.shape), n) == shape for p in pieces)
    assert kind.local_shape(shape, n) == tuple(pieces[0].shape)
    again = from_record(*kind.record(n))
    assert torch.equal(again.join(pieces), full)


def test_layouts_are_megatrons():
    """What each rank holds, written out by hand for small fused tensors."""
    r = torch.arange(12.0)
    gate_up = Fused((6, 6))  # rank 1 of 2: [gate_1; up_1]
    assert gate_up.shard(r, 2, 1).tolist() == [3, 4, 5, 9, 10, 11]
    qkv = Fused((8, 2, 2), 2)  # q: 2 groups of 4 rows, k and v: a row per group; rank 1 of 2 holds group 1
    assert qkv.shard(r, 2, 1).tolist() == [4, 5, 6, 7, 9, 11]
    one = Fused((8, 2, 2), 1).select((0, 1, 2))  # 1 KV group over 4 ranks: a quarter of q, copies of k and v
    assert one.shard(torch.arange(12.0), 4, 3).tolist() == [6, 7, 8, 9, 10, 11]
    assert Fused((8, 2, 2), 1).local_rows(4) == 2 + 4
    assert EXPERT_COLS.shard(torch.arange(6.0).view(1, 6), 3, 1).tolist() == [[1, 4]]
    assert Vocab(5, 2).shard(torch.arange(5.0), 2, 1).tolist() == [4, 0, 0, 0]  # 8 rows: 2 x 2 x 2
    assert Fused((6, 6)).select((1,)) is ROWS and Fused((8, 2, 2), 2).select((0,)) is ROWS
    k = Fused((8, 2, 2), 1).select((1,))  # k_proj's rows of 1 KV group over 2 ranks: both hold the copy
    assert [k.shard(torch.arange(2.0), 2, i).tolist() for i in (0, 1)] == [[0, 1], [0, 1]] and k.copies(2) == (2, 2)
    assert Fused((8, 2, 2), 2).select((1,)).shard(torch.arange(2.0), 2, 1).tolist() == [1]  # whole groups: rows
    assert Fused((8, 2, 2), 2).select((1,)).record(2) == ROWS.record(2) and Fused((8, 2, 2), 1).copies(4) == (4, 4)


def test_blocks_interleave_is_a_permutation():
    b = Blocks(3, (6, 3))
    t = torch.arange(9.0)
    assert b.interleave(t).tolist() == [0, 1, 6, 2, 3, 7, 4, 5, 8]
    assert torch.equal(b.deinterleave(b.interleave(t)), t)
