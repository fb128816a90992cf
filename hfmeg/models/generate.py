"""Inference over any TP/PP/VPP layout: full logits and greedy generation.

This is the simple, unpipelined path used for parity checks and demos: one batch
goes through the model chunks in model order, hidden states hop between stages
through the pipeline's own point-to-point transfers (`parallel.p2p`), and the last
stage gathers the vocab-parallel logits. Training uses the schedules in
`hfmeg.parallel.pipeline` instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.comm import gather_last_dim
from ..parallel.p2p import ACTIVATION, P2P, Transfer
from ..parallel.state import ParallelState
from .decoder import ModelChunk


@torch.no_grad()
def full_logits(chunks: list[ModelChunk], ps: ParallelState, input_ids: torch.Tensor,
                position_ids: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """Unpadded logits `[b, s, vocab]` on last-stage ranks, None on the others.

    `chunks` are this rank's model chunks in virtual-stage order; model chunk
    `v * pp + pp_rank` is `chunks[v]`. Every rank must pass the same `input_ids` (and, for rows
    packed with several documents, the same `position_ids` and `segment_ids`, which every chunk's
    attention reads). The batch is one micro-batch (index 0) of the pipeline's activation traffic.
    """
    b, s = input_ids.shape
    cfg = chunks[0].cfg
    dtype = next(chunks[0].parameters()).dtype
    local_s = s // ps.tp if ps.sequence_parallel else s
    n = ps.pp * len(chunks)
    p2p = P2P(n)
    in_flight = []  # sends, kept alive until they complete
    logits, x = None, input_ids
    for idx in range(n):
        owner, v = idx % ps.pp, idx // ps.pp
        if owner != ps.pp_rank:
            continue
        if idx > 0 and ps.pp > 1:
            x = torch.empty(local_s, b, chunks[v].stage_width, dtype=dtype, device=ps.device)
            p2p.exchange([Transfer(x, ps.stage_rank((idx - 1) % ps.pp), ACTIVATION, idx - 1, 0, is_send=False)])
        x = chunks[v](x, seq_len=s, position_ids=position_ids, segment_ids=segment_ids)
        if idx == n - 1:
            logits = gather_last_dim(x, ps)[..., : cfg.vocab_size].float()
        elif ps.pp > 1:
            send = Transfer(x.contiguous(), ps.stage_rank((idx + 1) % ps.pp), ACTIVATION, idx, 0, is_send=True)
            in_flight += p2p.exchange([send])
    for _, work in in_flight:
        work.wait()
    return logits


@torch.no_grad()
def greedy_generate(
    chunks: list[ModelChunk], ps: ParallelState, input_ids: torch.Tensor, max_new_tokens: int,
    logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Greedy decoding without a KV cache; every rank returns the same `[b, s + new]` ids.

    `logits`: `full_logits` of `input_ids` where the caller already has them on every rank (as `sharded_outputs`
    does): the first token is picked from them, without running that forward again.
    Under sequence parallelism every running length must be divisible by TP, which
    a token-by-token loop cannot keep; generate with chunks built without SP.
    """
    ids = input_ids.to(ps.device)
    last = ps.stage_rank(ps.pp - 1)
    for step in range(max_new_tokens):
        if step > 0 or logits is None:
            logits = full_logits(chunks, ps, ids)
        nxt = (logits[:, -1].argmax(-1).to(ps.device) if logits is not None
               else torch.empty(ids.shape[0], dtype=torch.long, device=ps.device))
        if ps.pp > 1:
            dist.broadcast(nxt, src=last, group=ps.pp_group)
        ids = torch.cat([ids, nxt[:, None].to(ids.dtype)], dim=1)
    return ids
