"""Packing documents into fixed `seq_len` rows.

Greedy, in stream order: documents are appended to the open row while they fit;
a document that does not fit closes the row (the rest is padding) and opens the
next one. Documents are never split across rows here, so each keeps its full
attention context (`overlong: split` cuts long texts beforehand). Without packing
every document gets its own padded row.

A row of documents d_1..d_n (lengths L_i, sum <= seq_len) becomes
- `input_ids`: the documents' tokens, then `pad_id`;
- `labels`, pre-shifted: `labels[t] = input_ids[t+1]` when t and t+1 are in the same
  document and token t+1 is a loss target; -100 at each document's last token,
  on masked (prompt) targets and on padding;
- `position_ids`: 0..L_i-1 restarting for each document (padding: 0..);
- `segment_ids`: i for document i, 0 for padding, so `ModelChunk`'s
  block-diagonal causal mask (`models.document_attention`) keeps
  attention inside each document; padding attends only to padding, so no
  attention row is empty.
Hence the loss of a packed row is exactly the sum of its documents' unpacked losses.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .formats import Doc

IGNORE = -100


def build_row(docs: list[Doc], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    ids = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE, dtype=np.int64)
    pos = np.zeros(seq_len, dtype=np.int64)
    seg = np.zeros(seq_len, dtype=np.int64)
    t = 0
    for k, d in enumerate(docs, 1):
        n = len(d.ids)
        ids[t:t + n] = d.ids
        labels[t:t + n - 1] = np.where(d.target[1:], d.ids[1:], IGNORE)
        pos[t:t + n] = np.arange(n)
        seg[t:t + n] = k
        t += n
    pos[t:] = np.arange(seq_len - t)
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "segment_ids": seg}


class Packer:
    """Turns a stream of documents into rows; its open row and finished rows are its state."""

    def __init__(self, seq_len: int, packing: bool, pad_id: int):
        self.seq_len, self.packing, self.pad_id = seq_len, packing, pad_id
        self.open: list[Doc] = []
        self.ready: list[list[Doc]] = []  # finished rows not yet handed out

    def add(self, doc: Doc) -> None:
        assert len(doc.ids) <= self.seq_len
        if not self.packing:
            self.ready.append([doc])
            return
        if sum(len(d.ids) for d in self.open) + len(doc.ids) > self.seq_len:
            self.ready.append(self.open)
            self.open = []
        self.open.append(doc)

    def add_record(self, docs: list[Doc]) -> None:
        """A record's documents (pieces of a split one are independent; pairs pack as one: data/pairs.py)."""
        for d in docs:
            self.add(d)

    def flush(self) -> None:
        """Close the open row (end of a finite stream)."""
        if self.open:
            self.ready.append(self.open)
            self.open = []

    def take(self) -> list[Doc]:
        """The documents of the next finished row (`build_row` makes it arrays)."""
        return self.ready.pop(0)

    def copy(self) -> Packer:
        """A snapshot: rows are never changed once finished and documents never at all."""
        p = Packer(self.seq_len, self.packing, self.pad_id)
        p.open, p.ready = list(self.open), list(self.ready)
        return p

    def state_dict(self) -> dict[str, Any]:
        return {"open": [_doc_out(d) for d in self.open], "ready": [[_doc_out(d) for d in r] for r in self.ready]}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.open = [_doc_in(x) for x in d["open"]]
        self.ready = [[_doc_in(x) for x in r] for r in d["ready"]]


def _doc_out(d: Doc) -> dict[str, Any]:
    return {"ids": d.ids.tolist(), "target": np.flatnonzero(d.target).tolist()}


def _doc_in(x: dict[str, Any]) -> Doc:
    ids = np.asarray(x["ids"], dtype=np.int64)
    target = np.zeros(len(ids), dtype=bool)
    target[np.asarray(x["target"], dtype=np.int64)] = True
    return Doc(ids, target)


def single_document(segment_ids: torch.Tensor) -> bool:
    """Whether every row of `segment_ids` `[b, s]` is one document (no mask needed; a host sync if the
    ids are on a device)."""
    return bool((segment_ids == segment_ids[:, :1]).all())
