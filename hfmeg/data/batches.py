"""Layout-invariant global batches, sliced per data-parallel rank.

Global batch k is rows `k*G .. (k+1)*G - 1` of the one row stream, whatever the
TP/PP/DP layout: every rank computes the same stream (the data pipeline is
deterministic), DP rank r keeps rows `r*G/DP .. (r+1)*G/DP - 1` and splits them
into micro-batches of `micro_batch_size` rows. TP ranks and PP stages of one
replica share a DP rank and so get the same micro-batches; every stage needs
`position_ids`/`segment_ids` (RoPE and the document mask), the first stage
`input_ids`, the last `labels`.

`num_tokens` counts the non-ignored labels of the WHOLE global batch, which is the
loss normaliser of the project's loss contract (sum of per-token losses / that
count, summed over micro-batches and DP ranks). Every rank holds the whole global
batch, so it needs no communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import LayoutError
from .packing import IGNORE

KEYS = ("input_ids", "labels", "position_ids", "segment_ids")


@dataclass
class StepBatch:
    microbatches: list[dict[str, torch.Tensor]]  # this DP rank's, each [micro_batch_size, seq_len] int64
    num_tokens: int  # non-ignored labels in the whole global batch


def check_batch_layout(global_batch_size: int, micro_batch_size: int, dp_size: int, dp_rank: int) -> None:
    if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise LayoutError(f"bad data layout: micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, "
                          f"dp_size={dp_size}")
    if global_batch_size % (micro_batch_size * dp_size):
        raise LayoutError(f"global_batch_size {global_batch_size} is not a multiple of "
                          f"micro_batch_size x DP = {micro_batch_size} x {dp_size}")


def count_tokens(labels: np.ndarray | torch.Tensor) -> int:
    return int((labels != IGNORE).sum())


def stack_rows(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([r[k] for r in rows]) for k in KEYS}


def dp_slice(batch: dict[str, np.ndarray], dp_rank: int, dp_size: int, micro_batch_size: int) -> StepBatch:
    """This DP rank's micro-batches of a global batch `{key: [G, s]}`."""
    g = batch["labels"].shape[0]
    per_rank = g // dp_size
    lo = dp_rank * per_rank
    micro = [
        {k: torch.from_numpy(batch[k][i:i + micro_batch_size].copy()) for k in KEYS}
        for i in range(lo, lo + per_rank, micro_batch_size)
    ]
    return StepBatch(micro, count_tokens(batch["labels"]))
