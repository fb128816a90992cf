"""Contiguous parameter / gradient buffers and their deterministic bucket layout.

For each model chunk and each parameter dtype there is one `BufferGroup`: a flat
parameter buffer (the model's parameters become views into it) and a flat fp32
main-gradient buffer with the same layout (`param.main_grad` is a view into it).
With expert parallelism (`expert_shards` given) the routed experts' parameters (role
`expert`) get a group of their own after it, whose buckets (`Bucket.expert`) split
into `expert_shards` shards: they are summed and sharded over the expert-data-parallel
group, not the DP group (data_parallel.py).

Bucket assignment (deterministic: it depends only on the chunk's parameter list,
`bucket_size`, the DP size and the pipeline/tie flags, so every rank of a TP or DP
group computes the same layout):

1. Parameters requiring gradients are taken in *gradient-ready order*: the reverse
   of their registration order, which for `ModelChunk` is forward order (embeddings,
   layers 0..n, final norm, LM head), so the LM head's gradient is ready first.
2. Walking that order, parameters are appended to the open bucket; the bucket is
   closed once it holds at least `bucket_size` elements. A parameter is never split
   between buckets.
3. A tied-embedding copy (a parameter whose role has a `tied` group: `embed.weight`
   on the first stage, `lm_head.weight` on the last; only when PP > 1) gets a bucket
   of its own, so its DP shard boundaries are identical on both stages and the shard
   can be summed over the embedding group directly.
4. Each bucket is padded with zeros to a multiple of `shards` (the DP size for the
   sharded modes; the expert-DP size for expert buckets) so that it splits into
   `shards` equal, contiguous shards. Shard `r` belongs to rank `r` of the bucket's
   group; a parameter may straddle a shard boundary.

Buckets are numbered globally across groups in construction order (chunk 0 first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .roles import ParamRole, named_roles


@dataclass
class Slot:
    """One parameter's place inside its bucket."""

    name: str
    param: nn.Parameter
    role: ParamRole
    offset: int  # element offset inside the bucket
    numel: int


@dataclass
class Bucket:
    index: int
    chunk: int
    start: int  # element offset inside the group buffers
    size: int  # padded size, a multiple of `shards`
    shards: int
    slots: list[Slot] = field(default_factory=list)
    param_buf: torch.Tensor | None = None  # views of the group buffers [start, start + size)
    grad_buf: torch.Tensor | None = None
    isolated: bool = False  # a tied-embedding bucket
    expert: bool = False  # routed experts' parameters, summed over the expert-DP group

    @property
    def shard_size(self) -> int:
        return self.size // self.shards

    def shard(self, buf: torch.Tensor, rank: int) -> torch.Tensor:
        n = self.shard_size
        return buf[rank * n : (rank + 1) * n]

    def runs(self, rank: int, key) -> list[tuple[int, int, object]]:
        """Ranges [lo, hi) of shard `rank` (shard-relative) of consecutive parameters with equal `key(slot)`."""
        base = rank * self.shard_size
        runs: list[list] = []
        for slot, lo, hi in self.segments(rank):
            a, b, k = slot.offset + lo - base, slot.offset + hi - base, key(slot)
            if runs and runs[-1][2] == k and runs[-1][1] == a:
                runs[-1][1] = b
            else:
                runs.append([a, b, k])
        return [tuple(r) for r in runs]

    def shared_runs(self, rank: int) -> list[tuple[int, int, int]]:
        """(lo, hi, n): the ranges of shard `rank` (shard-relative) that hold rows `n` TP ranks share
        (`ParamRole.shared_rows`)."""
        base, out = rank * self.shard_size, []
        for slot, lo, hi in self.segments(rank):
            span = slot.role.shared_span(slot.param.shape)
            if span is not None and max(lo, span[0]) < min(hi, span[1]):
                out.append((slot.offset + max(lo, span[0]) - base, slot.offset + min(hi, span[1]) - base,
                            slot.role.shared_by))
        return out

    def segments(self, rank: int) -> list[tuple[Slot, int, int]]:
        """(slot, lo, hi): the part [lo, hi) of each parameter's flat range inside shard `rank`."""
        a, b = rank * self.shard_size, (rank + 1) * self.shard_size
        out = []
        for s in self.slots:
            lo, hi = max(a, s.offset), min(b, s.offset + s.numel)
            if lo < hi:
                out.append((s, lo - s.offset, hi - s.offset))
        return out


@dataclass
class BufferGroup:
    chunk: int
    dtype: torch.dtype
    param_buffer: torch.Tensor
    grad_buffer: torch.Tensor
    buckets: list[Bucket]


Named = list[tuple[str, nn.Parameter, ParamRole]]


def plan_buckets(named: Named, pp: int, bucket_size: int, shards: int, first_index: int, chunk: int,
                 expert: bool = False) -> list[Bucket]:
    """Cut `named` (already in gradient-ready order) into padded buckets; see the module docstring."""
    buckets: list[Bucket] = []
    open_slots: Named = []
    open_numel = cursor = 0

    def close(slots, alone=False):
        nonlocal cursor
        if not slots:
            return
        b = Bucket(first_index + len(buckets), chunk, cursor, 0, shards, isolated=alone, expert=expert)
        offset = 0
        for name, p, role in slots:
            b.slots.append(Slot(name, p, role, offset, p.numel()))
            offset += p.numel()
        b.size = -(-offset // shards) * shards
        cursor += b.size
        buckets.append(b)

    for name, p, role in named:
        if pp > 1 and role.tied is not None:  # a tied copy summed across pipeline stages
            close(open_slots)
            open_slots, open_numel = [], 0
            close([(name, p, role)], alone=True)
            continue
        open_slots.append((name, p, role))
        open_numel += p.numel()
        if open_numel >= bucket_size:
            close(open_slots)
            open_slots, open_numel = [], 0
    close(open_slots)
    return buckets


def bucket_parts(named: Named, shards: int, expert_shards: int | None) -> list[tuple[Named, int, bool]]:
    """(parameters, shards, expert) of each buffer group `named` becomes: one group, or with
    `expert_shards` given (EP > 1) the routed experts in a group of their own after the rest."""
    if expert_shards is None:
        return [(named, shards, False)]
    return [([x for x in named if not x[2].expert], shards, False),
            ([x for x in named if x[2].expert], expert_shards, True)]


def build_groups(chunks: list[nn.Module], pp: int, bucket_size: int, shards: int,
                 grad_dtype: torch.dtype = torch.float32, expert_shards: int | None = None) -> list[BufferGroup]:
    """Allocate the buffers, move every parameter into them and set `param.main_grad`.

    `expert_shards`: put the experts' parameters into groups of their own cut into that many
    shards (None: experts are ordinary parameters, as at EP = 1)."""
    groups: list[BufferGroup] = []
    index = 0
    for c, chunk in enumerate(chunks):
        named = [(n, p, r) for n, p, r in named_roles(chunk) if p.requires_grad][::-1]
        for dtype in sorted({p.dtype for _, p, _ in named}, key=str):
            mine = [(n, p, r) for n, p, r in named if p.dtype == dtype]
            for part, n_shards, expert in bucket_parts(mine, shards, expert_shards):
                if part:
                    buckets = plan_buckets(part, pp, bucket_size, n_shards, index, c, expert)
                    index += len(buckets)
                    groups.append(_allocate(c, dtype, grad_dtype, part, buckets))
    return groups


def _allocate(chunk: int, dtype: torch.dtype, grad_dtype: torch.dtype, named: Named,
              buckets: list[Bucket]) -> BufferGroup:
    total = sum(b.size for b in buckets)
    device = named[0][1].device
    pbuf = torch.zeros(total, dtype=dtype, device=device)
    gbuf = torch.zeros(total, dtype=grad_dtype, device=device)
    for b in buckets:
        b.param_buf, b.grad_buf = pbuf[b.start : b.start + b.size], gbuf[b.start : b.start + b.size]
        for s in b.slots:
            view = b.param_buf[s.offset : s.offset + s.numel].view_as(s.param)
            view.copy_(s.param.detach())
            s.param.data = view
            s.param.main_grad = b.grad_buf[s.offset : s.offset + s.numel].view_as(s.param)
    return BufferGroup(chunk, dtype, pbuf, gbuf, buckets)
