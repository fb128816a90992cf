"""Document-causal attention for packed rows, without a dense mask where it can.

A packed row holds several documents (`segment_ids`: i for document i, 0 for
padding); a token attends to the earlier tokens of its own document only. The
boolean `[b, 1, s, s]` mask that says so keeps SDPA off its flash kernels and makes
it compute every block, although most blocks of a packed causal row are empty.
`plan` looks at the micro-batch once (not per layer) and picks:

- every row one document (or no `segment_ids`): plain causal SDPA (`is_causal=True`,
  flash on GPUs, blocks above the diagonal skipped). Staging (models/staging.py) decides
  it on the host, where the micro-batch is made, and passes no `segment_ids` for such rows
  (`single_document`); `plan` checks again only ids that live on the host, as reading a
  bool from a device tensor would stall the host once per micro-batch (ids given on a GPU
  get a mask, which computes the same function);
- packed rows on CUDA with heads of at least 16 dimensions (`flex_applies`):
  `flex_attention` with a `BlockMask` built from `segment_ids` (by staging, ahead of the
  step, where it can):
  blocks outside every document are skipped, blocks wholly inside one are computed
  without evaluating the mask, and GQA K/V heads are shared (`enable_gqa`), not
  repeated;
- packed rows elsewhere: SDPA with the dense mask. flex_attention's Triton kernels
  refuse heads under 16 dimensions (tiny models such as stories260K have 8); on CPU
  it has no backward (torch 2.13) and its eager form materialises the scores anyway;
  its forward is tested there against the dense mask (tests/test_attention.py).

All three compute the same function: on a row of one document the dense mask is
exactly the causal one.

Sliding windows (`ModelConfig.window`): a query at row position i sees keys j with
i - w < j <= i (transformers' `sliding_window_overlay`), besides the document mask.
Where a row is longer than the model's window, the planner builds a second mask for the
windowed layers (`DocumentMask.sliding`, the same three forms, a mask even for rows of
one document), which `layer_mask` hands them; the other layers keep the one above.

Soft-capped scores (Gemma 2, `attend(softcap=...)`): flex caps them in its `score_mod`, so a
capped model's one-document rows take a causal block mask where flex applies; elsewhere the
scores are computed explicitly (SDPA has no hook), `b·heads·s²` of them saved for backward.
Attention sinks (gpt-oss, `attend(sinks=...)`) take the same paths: flex returns its logsumexp and
the output is rescaled to the normaliser with the sink (a `score_mod` cannot add a column); the
explicit path appends the sink's column to the scores, as transformers' eager attention does.

Under context parallelism (parallel/context.py) a rank's queries are a subset of the
row's positions and its keys the whole gathered row in another order; `plan_split`
builds the same document-causal mask (and window) from both sides' row positions and
document ids (dense, or a flex block mask where `flex_applies`). Plain causal SDPA cannot serve
there, as the diagonal of the rectangle is not the row's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from ..data.microbatch import MicroBatch, token_index
from ..data.packing import single_document
from ..errors import LayoutError
from ..parallel.context import gathered_index
from .gated_delta_rule import document_runs


@dataclass(frozen=True)
class DocumentMask:
    """The packed-row mask of one micro-batch: a flex `BlockMask`, or the dense boolean mask."""

    block: BlockMask | None = None
    dense: torch.Tensor | None = None  # [b, 1, s, s], True where attention is allowed (CP: additive, see plan_split)
    reads: tuple[torch.Tensor, ...] = ()  # what the block mask's function reads (positions, document ids)
    # The mask of the layers with a sliding window (`ModelConfig.window`), where the row is longer than the
    # window; this mask's own `block` and `dense` both None: the other layers attend plain causal.
    sliding: DocumentMask | None = None
    # Each token's document `[b, s]` (`gated_delta_rule.document_runs`), where the row holds several: where the
    # linear-attention layers restart their state (`MaskPlanner.recurrent`); None elsewhere.
    documents: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the attention reads through this mask (models/staging.py hands them across streams)."""
        held = self.block.as_tuple() if self.block is not None else (self.dense,)
        inner = self.sliding.tensors() if self.sliding is not None else []
        return [t for t in (*held, *self.reads, self.documents) if isinstance(t, torch.Tensor)] + inner


def document_causal_mask(segment_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Boolean `[b, 1, s, s]` mask: causal, no attention across packed documents, and (given a `window`) a
    query at position i sees keys at positions j > i - window only."""
    index = torch.arange(segment_ids.shape[1], device=segment_ids.device)
    return split_causal_mask(index, index, segment_ids, segment_ids, window)


def split_causal_mask(q_index: torch.Tensor, kv_index: torch.Tensor, q_segments: torch.Tensor | None,
                      kv_segments: torch.Tensor | None, window: int | None = None) -> torch.Tensor:
    """Boolean `[b or 1, 1, sq, skv]` mask of queries at row positions `q_index` `[sq]` over keys at
    `kv_index` `[skv]`: causal in the row, within `window` positions back (transformers'
    `sliding_window_overlay`: `kv > q - window`), and (given the document ids `[b, sq]`, `[b, skv]`) never
    across documents."""
    back = q_index[:, None] - kv_index[None, :]
    allowed = back >= 0
    if window is not None:
        allowed = allowed & (back < window)
    allowed = allowed.unsqueeze(0)
    if q_segments is not None:
        allowed = allowed & (q_segments[:, :, None] == kv_segments[:, None, :])
    return allowed.unsqueeze(1)


def document_block_mask(segment_ids: torch.Tensor) -> DocumentMask:
    """The same mask as `document_causal_mask`, as a flex-attention block mask (one for all heads)."""
    index = torch.arange(segment_ids.shape[1], device=segment_ids.device)
    return split_block_mask(index, index, segment_ids, segment_ids)


TILE = 128  # flex_attention's block: a BlockMask says per (query tile, key tile) pair: skip, compute, or mask


def _tile_ranges(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per TILE of the last dim of `values`: its min, its max, and whether the tile is whole (the last one
    may be short: it is padded with its own last value, which moves neither)."""
    n = values.shape[-1]
    pad = -n % TILE
    whole = torch.ones(-(-n // TILE), dtype=torch.bool, device=values.device)
    if pad:
        values = torch.cat([values, values[..., -1:].expand(*values.shape[:-1], pad)], dim=-1)
        whole[-1] = False
    tiles = values.unflatten(-1, (-1, TILE))
    return tiles.amin(-1), tiles.amax(-1), whole


def _tile_lists(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A BlockMask's form of the key tiles `chosen` `[b, 1, q tiles, kv tiles]` per query tile: their count,
    and their indices first (ascending) in a row of all indices."""
    count = chosen.sum(-1, dtype=torch.int32)
    order = torch.argsort(chosen.to(torch.int8), dim=-1, descending=True, stable=True)
    return count, order.to(torch.int32)


def split_block_mask(q_index: torch.Tensor, kv_index: torch.Tensor, q_segments: torch.Tensor | None,
                     kv_segments: torch.Tensor | None, window: int | None = None) -> DocumentMask:
    """The same mask as `split_causal_mask`, as a flex-attention block mask (one for all heads).

    The tiles are classified from their ranges alone, with tensor ops and no compiler (so it can run in the
    data thread, models/staging.py): from the min and max of each tile's row positions and document ids, a
    (query tile, key tile) pair is
    - skipped when no pair of tokens can be allowed: every key after every query, every key `window` or
      more positions before every query, or the two tiles' document-id ranges disjoint (no id in both);
    - computed without the mask when every pair is: every key at or before every query and less than
      `window` positions before it, and both tiles wholly in one and the same document (and neither tile
      short);
    - computed with the mask function otherwise.
    Both rules are sufficient conditions, so the mask is exact for any ids and positions; they are also
    necessary (no tile computed that a per-element scan would skip) for rows of consecutive documents cut
    into tiles of consecutive positions, as packing makes them (padding, id 0 after the last document, is
    ranked last for the ranges). `create_block_mask` evaluates the mask function on every element instead:
    compiled on a GPU (a few ms per micro-batch), eagerly `b·sq·skv` elements of memory."""
    b = q_segments.shape[0] if q_segments is not None else 1

    def same_document_causal(batch, head, q, kv):
        back = q_index[q] - kv_index[kv]
        causal = back >= 0
        if window is not None:
            causal = causal & (back < window)
        if q_segments is None:
            return causal
        return (q_segments[batch, q] == kv_segments[batch, kv]) & causal

    q_lo, q_hi, q_whole = _tile_ranges(q_index)
    kv_lo, kv_hi, kv_whole = _tile_ranges(kv_index)
    empty = (kv_lo[None, :] > q_hi[:, None]).expand(b, -1, -1)
    full = (kv_hi[None, :] <= q_lo[:, None]) & q_whole[:, None] & kv_whole[None, :]
    if window is not None:  # the nearest pair `window` or more apart: none seen; the farthest nearer: all
        empty = empty | (q_lo[:, None] - kv_hi[None, :] >= window)
        full = full & (q_hi[:, None] - kv_lo[None, :] < window)
    if q_segments is not None:
        def ranked(seg):  # padding (0) after every document, so ids rise along a packed row
            return torch.where(seg == 0, torch.iinfo(seg.dtype).max, seg)
        qs_lo, qs_hi, _ = _tile_ranges(ranked(q_segments))
        ks_lo, ks_hi, _ = _tile_ranges(ranked(kv_segments))
        empty = empty | (qs_hi[:, :, None] < ks_lo[:, None, :]) | (ks_hi[:, None, :] < qs_lo[:, :, None])
        one_document = (qs_lo == qs_hi)[:, :, None] & (ks_lo == ks_hi)[:, None, :]
        full = full & one_document & (qs_lo[:, :, None] == ks_lo[:, None, :])
    full = full.expand(b, -1, -1) & ~empty
    partial = ~empty & ~full
    block = BlockMask.from_kv_blocks(*_tile_lists(partial.unsqueeze(1)), *_tile_lists(full.unsqueeze(1)),
                                     BLOCK_SIZE=TILE, mask_mod=same_document_causal,
                                     seq_lengths=(len(q_index), len(kv_index)))
    reads = (q_index, kv_index) + ((q_segments, kv_segments) if q_segments is not None else ())
    return DocumentMask(block=block, reads=reads)


FLEX_MIN_HEAD_DIM = 16


def flex_applies(device: torch.device, head_dim: int) -> bool:
    """Whether packed rows get flex_attention: a fused kernel with a backward only on CUDA, for heads >= 16."""
    return device.type == "cuda" and head_dim >= FLEX_MIN_HEAD_DIM


def plan(segment_ids: torch.Tensor | None, flex: bool) -> DocumentMask | None:
    """The mask for a micro-batch; None means plain causal attention (see the module doc)."""
    if segment_ids is None or (not segment_ids.is_cuda and single_document(segment_ids)):
        return None
    if flex:
        return document_block_mask(segment_ids)
    return DocumentMask(dense=document_causal_mask(segment_ids))


def plan_split(q_index: torch.Tensor, kv_index: torch.Tensor, q_segments: torch.Tensor | None,
               kv_segments: torch.Tensor | None, flex: bool, dtype: torch.dtype,
               window: int | None = None) -> DocumentMask:
    """The mask of a context-parallel rank's queries over the gathered keys (module doc).

    The dense form is additive (0 or -inf) in the compute dtype: SDPA turns a boolean mask
    into such a tensor in every layer and saves that copy for backward, s/cp x s elements
    per layer; given one, it saves the tensor it was given, once per chunk."""
    if flex:
        return split_block_mask(q_index, kv_index, q_segments, kv_segments, window)
    allowed = split_causal_mask(q_index, kv_index, q_segments, kv_segments, window)
    return DocumentMask(dense=torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
                        .masked_fill_(~allowed, float("-inf")))


@dataclass(frozen=True)
class MaskPlanner:
    """How one rank's model attends packed rows (`ModelChunk.mask_planner`): the mask of a micro-batch,
    and whether it is small enough to build before the step (models/staging.py)."""

    device: torch.device
    cp: int
    cp_rank: int
    flex: bool  # `flex_applies` to this model on this device
    dtype: torch.dtype  # the compute dtype (CP's dense masks are additive in it)
    window: int | None = None  # the model's sliding window (`ModelConfig.window`), None where no layer has one
    # Soft-capped scores (Gemma 2) or attention sinks (gpt-oss): SDPA can do neither, so where flex applies even
    # one-document rows take a (causal) block mask, rather than the explicit dense path's s² scores.
    explicit: bool = False
    recurrent: bool = False  # the model has linear-attention layers: packed rows' masks carry `documents`

    def windowed(self, row: int) -> bool:
        """Whether rows of `row` tokens need the sliding-window mask: only rows longer than the window."""
        return self.window is not None and row > self.window

    def mask(self, segment_ids: torch.Tensor | None, s: int,
             row_segment_ids: torch.Tensor | None = None) -> DocumentMask | None:
        """The mask of a micro-batch of `s` tokens per row (under CP this rank's `s` of each row's `s * cp`,
        `row_segment_ids` the whole rows' document ids: parallel/context.py); None: plain causal attention.
        Rows longer than the window carry the windowed layers' mask too (`DocumentMask.sliding`)."""
        if self.cp == 1:
            docs = plan(segment_ids, flex=self.flex)
            if docs is not None and self.recurrent:
                docs = replace(docs, documents=document_runs(segment_ids))
            index = torch.arange(s, device=self.device)
            if docs is None and self.flex and self.explicit:
                docs = split_block_mask(index, index, None, None)
            if not self.windowed(s):
                return docs
            seg = segment_ids if docs is not None else None  # one document a row: positions alone
            if self.flex:
                sliding = split_block_mask(index, index, seg, seg, self.window)
            else:
                sliding = DocumentMask(dense=split_causal_mask(index, index, seg, seg, self.window))
            return replace(docs or DocumentMask(), sliding=sliding)
        if segment_ids is not None and row_segment_ids is None:
            raise LayoutError("under context parallelism a micro-batch with segment_ids needs row_segment_ids, "
                              "the whole rows' document ids (MicroBatch.shard)")
        row = s * self.cp
        kv_index = gathered_index(row, self.cp, self.device)
        kv_segments = row_segment_ids.index_select(1, kv_index) if row_segment_ids is not None else None
        q_index = token_index(row, self.cp, self.cp_rank, self.device)
        docs = plan_split(q_index, kv_index, segment_ids, kv_segments, self.flex, self.dtype)
        if not self.windowed(row):
            return docs
        # The window in the row's global positions: the split mask compares both sides' row positions.
        return replace(docs, sliding=plan_split(q_index, kv_index, segment_ids, kv_segments, self.flex, self.dtype,
                                                self.window))

    def builds_ahead(self, mb: MicroBatch) -> bool:
        """Whether the mask of micro-batch `mb` is a flex block mask (small: built ahead; a dense one is
        b·s² elements and built at use). Under CP every micro-batch has a mask, packed or not, and so has
        a row longer than the window, and every row of a soft-capped model or one with sinks."""
        return self.flex and (self.cp > 1 or mb.segment_ids is not None or self.windowed(mb.shape[1]) or self.explicit)


@cache
def _compiled_flex():
    # flex_attention is only a fused kernel when compiled; eager it materialises the scores.
    return torch.compile(flex_attention, dynamic=False)


def layer_mask(docs: DocumentMask | None, window: int | None, row: int) -> DocumentMask | None:
    """The mask a layer with sliding window `window` (None: none) attends rows of `row` tokens under."""
    if window is None or row <= window:
        return docs
    if docs is None or docs.sliding is None:
        raise LayoutError(f"a row of {row} tokens is longer than the sliding window {window}, but its mask was "
                          "planned without the window (MaskPlanner.window)")
    return docs.sliding


def _explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
              softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention with its scores computed explicitly (SDPA has no score hook), as transformers' eager Gemma and
    gpt-oss attention: scores = q·k * scale, soft-capped (cap * tanh(scores / cap)) where given, then the mask;
    with `sinks` `[heads]` each head's sink logit is a column of its own in the softmax (fp32), dropped after."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # query head i reads KV head i // rep
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    wide = torch.promote_types(scores.dtype, torch.float32)  # the softmax in fp32, or wider (float64 references)
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=wide).to(q.dtype), v)
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=wide)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


def _sunk(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention output `o` `[b, heads, s, d]` whose normaliser was exp(`lse`), rescaled to the normaliser with
    the sink: exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink), exact (no approximation), differentiable
    in `lse` (flex's backward takes its gradient) and in the sinks."""
    wide = torch.promote_types(o.dtype, torch.float32)
    return o * torch.sigmoid(lse.to(wide) - sinks.to(wide).view(1, -1, 1)).unsqueeze(-1).to(o.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: DocumentMask | None, scale: float,
           gqa: bool, softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of `q` `[b, heads, s, d]` over `k`, `v` `[b, kv_heads, s, d]` under `docs` (its own
    `block` or `dense`; both None: plain causal), the scores soft-capped at `softcap` where given, and a sink
    logit per head (`sinks` `[heads]`) in each query's normaliser where given. Flex caps in a score_mod and
    returns its logsumexp, by which the output is rescaled to the sink's normaliser (`_sunk`); the other paths
    compute the scores explicitly (`_explicit`)."""
    if docs is not None and docs.block is not None:
        flex = _compiled_flex() if q.is_cuda else flex_attention
        score_mod = None
        if softcap is not None:
            def score_mod(score, batch, head, q_idx, kv_idx):
                return torch.tanh(score / softcap) * softcap
        run = dict(score_mod=score_mod, block_mask=docs.block, scale=scale, enable_gqa=gqa)
        if sinks is None:
            return flex(q, k, v, **run)
        o, aux = flex(q, k, v, return_aux=AuxRequest(lse=True), **run)
        return _sunk(o, aux.lse, sinks)
    mask = docs.dense if docs is not None else None
    if softcap is not None or sinks is not None:
        return _explicit(q, k, v, mask, scale, softcap, sinks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                          enable_gqa=gqa)
