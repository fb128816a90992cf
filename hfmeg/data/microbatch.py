"""`MicroBatch`: the rows one forward/backward takes, from the data pipeline to the model.

One type travels data (batches.py makes it) -> staging (models/staging.py: `to`, the attention
decided) -> context-parallel split (`shard`) -> pipeline (parallel/pipeline.py: `shape`,
`step_shape`) -> model (`ModelChunk` reads its fields). What is done to a micro-batch is a
method here, so a caller never names its tensors one by one:

- `to(device)`: every tensor on the device; `record_stream(stream)`: every tensor marked as
  used by a stream (staging hands micro-batches from its side stream to the step's);
- `shard(cp_rank, cp)`: a context-parallel rank's tokens of each row (the load-balanced split,
  explained in parallel/context.py: chunks r and 2·cp−1−r of 2·cp);
- `shape`, `step_shape`: the `[b, s]` a step's micro-batches share (the pipeline sends activations
  of one shape); `label_tokens()`: the tokens that count in the loss.

Which tensor is which kind is declared once, on the field (`PER_TOKEN`, `PER_ROW`), and every
method walks the fields by kind, so a subclass that adds a field of a known kind is moved, split
and marked with no new code anywhere. That is how a second batch type plugs in: a preference
batch (chosen and rejected rows of several pairs, for DPO) is `MicroBatch` plus a per-row
`pair_index: torch.Tensor = field(metadata=PER_ROW)` (and, for pairs packed into one row, a
per-token field naming each document's pair); staging, the CP split and the pipeline take it as
they take SFT rows, and only its loss reads the pairs (class doc).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from typing import Protocol

import torch

from ..errors import LayoutError
from .packing import IGNORE

PER_TOKEN = {"kind": "token"}  # [b, s]: under CP this rank's tokens of each row, cut by `shard`
PER_ROW = {"kind": "row"}  # [b, ...]: one entry per row (under CP the whole row's), never cut


class StagedMask(Protocol):
    """An attention mask staging built ahead (models/document_attention.DocumentMask)."""

    def tensors(self) -> list[torch.Tensor]: ...


def split_chunks(seq_len: int, cp: int, cp_rank: int) -> tuple[range, range]:
    """The row positions CP rank `cp_rank` holds: chunks `cp_rank` and `2cp-1-cp_rank` of `2cp` equal ones."""
    if seq_len % (2 * cp):
        raise LayoutError(f"data.seq_len: {seq_len} tokens do not split into 2 x CP = {2 * cp} equal chunks "
                          f"(parallel.cp {cp}); use a multiple of {2 * cp}")
    c = seq_len // (2 * cp)
    late = 2 * cp - 1 - cp_rank
    return range(cp_rank * c, (cp_rank + 1) * c), range(late * c, (late + 1) * c)


def token_index(s: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """`split_chunks` as one index of row positions, made on `device` (no copy from the host, which on a GPU
    would wait for the stream)."""
    return torch.cat([torch.arange(r.start, r.stop, device=device) for r in split_chunks(s, cp, rank)])


@dataclass(frozen=True, kw_only=True)
class MicroBatch:
    """Rows of tokens `[b, s]` int64 (under CP, this rank's `s` tokens of each row).

    `labels` are pre-shifted (`-100`: no loss). `position_ids` None: 0..s-1 per row; `segment_ids`
    None: every row one document (data/packing.py says what packed rows hold). Under CP,
    `row_segment_ids` `[b, s * cp]` are the whole rows' document ids (the keys' documents, read
    without a collective: parallel/context.py). `docs`: the mask staging built ahead from the
    document ids, which it then drops (models/staging.py).

    A preference batch plugs in as a subclass: `PairBatch(MicroBatch)` with the chosen and the
    rejected rows of its pairs as the rows here and `pair_index: torch.Tensor = field(metadata=PER_ROW)`
    (which pair, and chosen or rejected, per row). `to`, `shard`, `record_stream` and the shape check
    carry the new field by its declared kind, and the model reads the same token fields, so staging,
    the CP split and the pipeline need no branch on the batch type. What differs is the loss: the
    pipeline's last stage reduces the per-token losses to a micro-batch loss, today their sum over
    `num_tokens`; DPO supplies another reduction (per-row log-probabilities grouped by `pair_index`),
    handed to the pipeline as a loss, not chosen there by the batch's type."""

    input_ids: torch.Tensor = field(metadata=PER_TOKEN)
    labels: torch.Tensor = field(metadata=PER_TOKEN)
    position_ids: torch.Tensor | None = field(default=None, metadata=PER_TOKEN)
    segment_ids: torch.Tensor | None = field(default=None, metadata=PER_TOKEN)
    row_segment_ids: torch.Tensor | None = field(default=None, metadata=PER_ROW)
    docs: StagedMask | None = None

    def __post_init__(self):
        if self.input_ids.dim() != 2:
            raise LayoutError(f"micro-batch input_ids: shape {tuple(self.input_ids.shape)}, not [rows, tokens]")
        for f, t in self._tensors_of("token"):
            if t.shape != self.input_ids.shape:
                raise LayoutError(f"micro-batch {f}: shape {tuple(t.shape)}, not input_ids' "
                                  f"{tuple(self.input_ids.shape)}")
        for f, t in self._tensors_of("row"):
            if t.shape[0] != self.input_ids.shape[0]:
                raise LayoutError(f"micro-batch {f}: {t.shape[0]} rows, not input_ids' {self.input_ids.shape[0]}")

    @property
    def shape(self) -> torch.Size:
        """`[b, s]`: rows, and tokens of each row (this CP rank's)."""
        return self.input_ids.shape

    def label_tokens(self) -> int:
        """The tokens whose label counts in the loss (a host sync if on a device)."""
        return int((self.labels != IGNORE).sum())

    def to(self, device: torch.device) -> MicroBatch:
        """The micro-batch with its tensors on `device` (a staged mask as it is: built there). Host -> CUDA
        copies go through pinned memory with `non_blocking`, so the host queues them and goes on launching
        kernels instead of waiting (the caching host allocator keeps the pinned buffer alive until its copy
        is done)."""
        def move(t: torch.Tensor) -> torch.Tensor:
            if device.type != "cuda":
                return t.to(device)
            return (t if t.is_cuda or t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)
        return replace(self, **{f: move(t) for f, t in self._tensors_of("token", "row")})

    def shard(self, cp_rank: int, cp: int) -> MicroBatch:
        """CP rank `cp_rank`'s tokens of these whole rows (parallel/context.py): every per-token tensor cut
        to `token_index`, position ids made where absent (a token keeps its row position), and with
        document ids the whole rows' ones as `row_segment_ids`. The identity at CP = 1."""
        if cp == 1:
            return self
        b, s = self.shape
        index = token_index(s, cp, cp_rank, self.input_ids.device)
        whole = replace(self, position_ids=self.position_ids if self.position_ids is not None
                        else torch.arange(s, device=index.device).expand(b, s),
                        row_segment_ids=self.segment_ids)
        return replace(whole, **{f: t.index_select(1, index) for f, t in whole._tensors_of("token")})

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark every tensor the step reads, the staged mask's too, as used by `stream`: when the step drops
        them, the caching allocator then does not hand their memory to another stream too early."""
        held = [t for _, t in self._tensors_of("token", "row")]
        for t in held + (self.docs.tensors() if self.docs is not None else []):
            t.record_stream(stream)

    def _tensors_of(self, *kinds: str) -> Iterable[tuple[str, torch.Tensor]]:
        for f in fields(self):
            t = getattr(self, f.name)
            if f.metadata.get("kind") in kinds and t is not None:
                yield f.name, t


def step_shape(microbatches: list[MicroBatch]) -> torch.Size:
    """The `[b, s]` every micro-batch of a step has; LayoutError if they differ (the pipeline's activations
    have one shape)."""
    shape = microbatches[0].shape
    if any(mb.shape != shape for mb in microbatches):
        raise LayoutError("all micro-batches of a step must have the same [batch, seq] shape")
    return shape
