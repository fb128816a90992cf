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

Which tensor is which kind is declared once, on the field (`PER_TOKEN`, `PER_ROW`, `PER_SEQUENCE`),
and every method walks the fields by kind, so a subclass that adds a field of a known kind is moved,
split and marked with no new code anywhere. That is how the second batch type plugs in: `PairBatch`,
the chosen and rejected sequences of several preference pairs (DPO), adds a per-token `sequence_ids`
(which sequence each label token belongs to) and per-sequence reference log-probabilities; staging,
the CP split and the pipeline take it as they take SFT rows, and only its loss reads the pairs.
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
PER_SEQUENCE = {"kind": "sequence"}  # [n]: one entry per sequence of a PairBatch (2 per pair), never cut


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

    `PairBatch` below is the preference subclass; the pipeline's loss, not the batch type, decides how
    the per-token losses become a micro-batch loss (parallel/pipeline.py)."""

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
        self._check_sequences()

    def _check_sequences(self) -> None:
        """A subclass with per-sequence fields checks their count here."""

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
        return replace(self, **{f: move(t) for f, t in self._tensors_of("token", "row", "sequence")})

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
        held = [t for _, t in self._tensors_of("token", "row", "sequence")]
        for t in held + (self.docs.tensors() if self.docs is not None else []):
            t.record_stream(stream)

    def _tensors_of(self, *kinds: str) -> Iterable[tuple[str, torch.Tensor]]:
        for f in fields(self):
            t = getattr(self, f.name)
            if f.metadata.get("kind") in kinds and t is not None:
                yield f.name, t


@dataclass(frozen=True, kw_only=True)
class PairBatch(MicroBatch):
    """The chosen and rejected sequences (prompt + answer) of `num_pairs` preference pairs, as rows.

    Each sequence is one document of a row (packed: several per row, with document ids and positions as
    for SFT; unpacked: one per row). Sequence `2p` is pair p's chosen answer, `2p + 1` its rejected one,
    and both sequences of a pair are in the same micro-batch. `labels` mark the answer tokens only (the
    prompt's are -100), and `sequence_ids` `[b, s]` say, for every position whose label counts, which
    sequence that label token belongs to (-1 elsewhere), so a sequence's log-probability is the sum of
    its tokens' (per-token loss negated) grouped by `sequence_ids`: under CP each rank sums its own
    tokens and the ranks add their sums. `ref_logps` `[2 * num_pairs]` float32: the reference model's
    log-probability of each sequence, once computed (None before)."""

    num_pairs: int
    sequence_ids: torch.Tensor = field(metadata=PER_TOKEN)
    ref_logps: torch.Tensor | None = field(default=None, metadata=PER_SEQUENCE)

    def _check_sequences(self) -> None:
        if self.num_pairs < 0:  # 0: padding rows only (the last eval batch's filler)
            raise LayoutError(f"preference micro-batch: {self.num_pairs} pairs")
        for f, t in self._tensors_of("sequence"):
            if t.shape[0] != 2 * self.num_pairs:
                raise LayoutError(f"preference micro-batch {f}: {t.shape[0]} sequences, not 2 x {self.num_pairs} "
                                  "pairs")


def step_shape(microbatches: list[MicroBatch]) -> torch.Size:
    """The `[b, s]` every micro-batch of a step has; LayoutError if they differ (the pipeline's activations
    have one shape)."""
    shape = microbatches[0].shape
    if any(mb.shape != shape for mb in microbatches):
        raise LayoutError("all micro-batches of a step must have the same [batch, seq] shape")
    return shape
