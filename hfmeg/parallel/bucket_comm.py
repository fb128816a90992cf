"""The two data-parallel collectives of the sharded buffers, one bucket at a time.

- `reduce_scatter_async(out, full, ...)`: sum `full` (a bucket of main grads) over
  DP and leave this rank's shard of the sum in `out`;
- `all_gather_async(out, shard, ...)`: fill `out` (a bucket of parameters) with
  every DP rank's updated shard.

Both return a handle with `wait()` and `is_completed()`. NCCL (and any backend
but gloo) uses its native `reduce_scatter_tensor` / `all_gather_into_tensor`; with
`async_op=True` they run on NCCL's own communication stream (the side stream) and
`wait()` makes the compute stream wait for them, so compute is never blocked by
the launch.

gloo's native versions move more bytes or take longer than the optimum of
(DP-1)/DP of the bucket in and out of each rank (the native reduce-scatter costs
more than a whole all-reduce; `tools/bench_collectives.py` measures both, and the
README records the figures). On gloo, therefore:

- reduce-scatter is an async `all_to_all_single`: rank r receives every rank's copy
  of shard r into a receive buffer, and `wait()` sums the DP copies, in rank order,
  into `out`. Receive buffers come from a `ScratchPool` of largest-bucket-sized
  tensors that lives as long as the data-parallel wrapper: a fresh multi-MB tensor
  per bucket per step is fresh pages for the kernel to fault in and zero, CPU time
  stolen from the backward the reduction should hide behind;
- all-gather is one `isend` of the own shard to each peer and one `irecv` from each
  peer straight into its slot of `out` (no staging copy). Messages carry the
  bucket's index as tag, so two buckets in flight between the same pair of ranks
  can never be matched crosswise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import all_gather_flat, reduce_scatter_flat


@dataclass(frozen=True)
class SumGroup:
    """The ranks that sum a bucket's gradients and share its shards: the DP group, or for expert
    buckets the expert-DP group. `group` is None in a world of one."""

    group: object
    size: int
    rank: int  # this process's index in `group`


def is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


class ScratchPool:
    """Reusable flat buffers of `numel` elements per dtype, handed out as leading slices."""

    def __init__(self, numel: int):
        self.numel = numel
        self._free: dict[torch.dtype, list[torch.Tensor]] = {}

    def take(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(a buffer shaped like `like`, the pooled tensor to give back)."""
        free = self._free.setdefault(like.dtype, [])
        flat = free.pop() if free else torch.empty(self.numel, dtype=like.dtype, device=like.device)
        return flat[: like.numel()].view_as(like), flat

    def give(self, flat: torch.Tensor) -> None:
        self._free[flat.dtype].append(flat)


class _AllToAllReduceScatter:
    """Async reduce-scatter of `full` into `out` (this rank's shard) as all-to-all + local sum (gloo)."""

    def __init__(self, out: torch.Tensor, full: torch.Tensor, group, pool: ScratchPool):
        self.out, self.dp, self.pool = out, dist.get_world_size(group), pool
        # recv[r * shard : (r + 1) * shard] = DP rank r's copy of our shard
        self.recv, self._flat = pool.take(full)
        self.work = dist.all_to_all_single(self.recv, full, group=group, async_op=True)

    def is_completed(self) -> bool:
        return self.recv is None or self.work.is_completed()

    def wait(self) -> None:
        if self.recv is None:  # already summed
            return
        self.work.wait()
        torch.sum(self.recv.view(self.dp, -1), dim=0, out=self.out)
        self.pool.give(self._flat)
        self.recv = self._flat = None


class _PointToPointAllGather:
    """Async all-gather of `shard` into `out`: the own shard to every peer, each peer's into its slot (gloo)."""

    def __init__(self, out: torch.Tensor, shard: torch.Tensor, group, tag: int):
        me, n = dist.get_rank(group), shard.numel()
        mine = out[me * n : (me + 1) * n]
        if mine.data_ptr() != shard.data_ptr():
            mine.copy_(shard)
        self.works = []
        for i, peer in enumerate(dist.get_process_group_ranks(group)):
            if i != me:
                self.works.append(dist.isend(shard, peer, group=group, tag=tag))
                self.works.append(dist.irecv(out[i * n : (i + 1) * n], peer, group=group, tag=tag))

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def reduce_scatter_async(out: torch.Tensor, full: torch.Tensor, group, pool: ScratchPool | None):
    """Start summing `full` over `group` into this rank's shard `out`; `pool` is required on gloo."""
    if is_gloo(group):
        return _AllToAllReduceScatter(out, full, group, pool)
    return reduce_scatter_flat(out, full, group=group, async_op=True)


def all_gather_async(out: torch.Tensor, shard: torch.Tensor, group, tag: int):
    """Start gathering every rank's `shard` of `group` into `out` (`tag`: unique among those in flight)."""
    if is_gloo(group):
        return _PointToPointAllGather(out, shard, group, tag)
    return all_gather_flat(out, shard, group=group, async_op=True)
