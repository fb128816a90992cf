"""Layout-invariant global batches, sliced per data-parallel rank.

Global batch k is rows `k*G .. (k+1)*G - 1` of the one row stream, whatever the
TP/PP/DP layout: every rank computes the same stream (the data pipeline is
deterministic), DP rank r keeps rows `r*G/DP .. (r+1)*G/DP - 1` and splits them
into micro-batches (`MicroBatch`, microbatch.py) of `micro_batch_size` rows. TP ranks
and PP stages of one replica share a DP rank and so get the same micro-batches; every
stage needs `position_ids`/`segment_ids` (RoPE and the document mask), the first stage
`input_ids`, the last `labels`.

`num_tokens` counts the non-ignored labels of the WHOLE global batch, which is the
loss normaliser of the project's loss contract (sum of per-token losses / that
count, summed over micro-batches and DP ranks). It is counted from the documents
of every row (a document's labels are its targets after its first token), so it
needs no communication.

Context parallelism (CP > 1): the CP ranks of a DP rank share its rows, and each
keeps only its tokens of every row (`MicroBatch.shard`, the load-balanced split of
parallel/context.py), so the tensors a CP rank holds are `seq_len / cp` long, plus
`row_segment_ids`, the whole rows' document ids `[b, seq_len]`: the attention mask of
a rank's queries over every rank's keys needs the keys' documents, which the rank then
reads here instead of all-gathering them. `num_tokens` is still the whole global batch's count.

Packing is sequential (where a row ends depends on the length of every earlier
document, known only once it is tokenised), so every rank still tokenises and
packs the whole global batch, as lists of documents; only this DP rank's rows become
arrays and tensors (`build_row`, `torch.from_numpy`), 1/DP of that work.

Preference pairs (`PairBatch`, data/pairs.py) come as row pairs (a pair's chosen sequences, then its rejected
ones), so `micro_batch_size` is even and a pair stays in one micro-batch; `num_pairs` and `chosen_tokens` are
counted from the documents as `num_tokens` is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import LayoutError
from .formats import Doc
from .microbatch import MicroBatch
from .packing import build_row
from .pairs import pairs_microbatch


@dataclass
class StepBatch:
    microbatches: list[MicroBatch]  # this DP rank's, each [micro_batch_size, seq_len / cp]
    num_tokens: int  # non-ignored labels in the whole global batch
    num_pairs: int = 0  # preference pairs (PairBatch) in the whole global batch: the DPO loss normaliser
    chosen_tokens: int = 0  # label tokens of their chosen answers: the normaliser of the NLL term on them


def check_batch_layout(global_batch_size: int, micro_batch_size: int, dp_size: int, dp_rank: int,
                       pairs: bool = False) -> None:
    if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise LayoutError(f"bad data layout: micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, "
                          f"dp_size={dp_size}")
    if pairs and micro_batch_size % 2:
        raise LayoutError(f"micro_batch_size {micro_batch_size} is odd: preference pairs take rows two by two (a "
                          "chosen row and a rejected row, data/pairs.py), so it must be even")
    if global_batch_size % (micro_batch_size * dp_size):
        raise LayoutError(f"global_batch_size {global_batch_size} is not a multiple of "
                          f"micro_batch_size x DP = {micro_batch_size} x {dp_size}")


def rows_microbatch(rows: list[list[Doc]], seq_len: int, pad_id: int) -> MicroBatch:
    """Rows given as their documents, as one micro-batch of whole rows (`build_row` each)."""
    built = [build_row(docs, seq_len, pad_id) for docs in rows]
    return MicroBatch(**{k: torch.from_numpy(np.stack([b[k] for b in built])) for k in built[0]})


def label_count(rows: list[list[Doc]]) -> int:
    return sum(int(d.target[1:].sum()) for docs in rows for d in docs)


def step_batch(rows: list[list[Doc]], seq_len: int, pad_id: int, dp_rank: int, dp_size: int,
               micro_batch_size: int, cp_rank: int = 0, cp_size: int = 1, pairs: bool = False) -> StepBatch:
    """This DP rank's micro-batches of a global batch given as each row's documents (this CP rank's tokens).

    `pairs`: the rows are row pairs of preference pairs (data/pairs.py), the micro-batches `PairBatch`es, and
    the step counts the global batch's pairs and chosen label tokens (the chosen sequences: even rows)."""
    per_rank = len(rows) // dp_size
    mine = rows[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    make = pairs_microbatch if pairs else rows_microbatch
    micro = [make(mine[i:i + micro_batch_size], seq_len, pad_id).shard(cp_rank, cp_size)
             for i in range(0, per_rank, micro_batch_size)]
    batch = StepBatch(micro, label_count(rows))
    if pairs:
        batch.num_pairs, batch.chosen_tokens = sum(len(r) for r in rows[::2]), label_count(rows[::2])
    return batch
