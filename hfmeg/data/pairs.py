"""Packing preference pairs into rows, and those rows as `PairBatch` micro-batches.

A pair's two sequences (prompt + chosen, prompt + rejected; data/preference.py) are each up to `seq_len` tokens
(TRL's `max_length`), so a pair takes two rows: pairs are packed into ROW PAIRS, chosen sequences in the first
row, rejected ones in the second, a pair joining the open row pair when both its sequences fit (each row
packed as SFT rows are: data/packing.py, one document per sequence, positions restarting, document ids for the
mask), else closing it. Without `data.packing` a row pair holds one pair. Global-batch rows `2u`, `2u + 1` are
row pair u, so with an even `micro_batch_size` a row pair, hence a pair, never straddles two micro-batches or
DP ranks, and the rows are the same whatever the layout (`micro_batch_size` included).

In a micro-batch, pair p is the p-th pair of its row pairs in order: sequence `2p` (chosen) is the k-th
document of row pair u's first row, `2p + 1` the k-th of its second, p = k + the pairs of the row pairs before u.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .formats import Doc
from .microbatch import PairBatch
from .packing import IGNORE, _doc_in, _doc_out, build_row


class PairPacker:
    """`Packer`'s interface for pairs: `add_record([chosen, rejected])`, `ready` rows (in row pairs), `take`."""

    def __init__(self, seq_len: int, packing: bool, pad_id: int):
        self.seq_len, self.packing, self.pad_id = seq_len, packing, pad_id
        self.open: list[list[Doc]] = [[], []]  # the open row pair: chosen sequences, rejected sequences
        self.ready: list[list[Doc]] = []

    def add_record(self, docs: list[Doc]) -> None:
        if not docs:
            return
        room = [self.seq_len - sum(len(d.ids) for d in row) for row in self.open]
        if not all(len(d.ids) <= r for d, r in zip(docs, room)):
            self.flush()
        for row, d in zip(self.open, docs):
            row.append(d)
        if not self.packing:
            self.flush()

    def flush(self) -> None:
        """Close the open row pair (end of a finite stream)."""
        if self.open[0]:
            self.ready += self.open
            self.open = [[], []]

    def take(self) -> list[Doc]:
        return self.ready.pop(0)

    def copy(self) -> PairPacker:
        p = PairPacker(self.seq_len, self.packing, self.pad_id)
        p.open, p.ready = [list(r) for r in self.open], list(self.ready)
        return p

    def state_dict(self) -> dict[str, Any]:
        return {"open": [[_doc_out(d) for d in r] for r in self.open],
                "ready": [[_doc_out(d) for d in r] for r in self.ready]}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.open = [[_doc_in(x) for x in r] for r in d["open"]]
        self.ready = [[_doc_in(x) for x in r] for r in d["ready"]]


def pairs_microbatch(rows: list[list[Doc]], seq_len: int, pad_id: int) -> PairBatch:
    """Whole row pairs (rows `2u`, `2u + 1`) as one `PairBatch`, sequences numbered from 0 (module docstring)."""
    built = [build_row(docs, seq_len, pad_id) for docs in rows]
    arrays = {k: np.stack([b[k] for b in built]) for k in built[0]}
    pairs = [len(r) for r in rows[::2]]
    before = np.repeat(np.cumsum([0] + pairs[:-1]), 2)[:, None]  # per row: pairs of the row pairs before it
    rejected = (np.arange(len(rows)) % 2)[:, None]
    sequence = 2 * (before + arrays["segment_ids"] - 1) + rejected
    sequence_ids = np.where(arrays["labels"] != IGNORE, sequence, -1)
    return PairBatch(**{k: torch.from_numpy(v) for k, v in arrays.items()}, num_pairs=sum(pairs),
                     sequence_ids=torch.from_numpy(sequence_ids))
