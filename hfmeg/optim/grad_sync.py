"""Gradient accumulation into the main-grad buffer and the bucketed DP reduction.

Every parameter gets a post-accumulate-grad hook. Autograd accumulates each
micro-batch's gradient into `param.grad`; for parameters whose dtype matches the
main-grad buffer, `param.grad` *is* the `main_grad` view, so autograd adds in place
and the hook has nothing to copy. Otherwise (bf16/fp16 parameters) the hook adds
`param.grad` into the fp32 `main_grad` and frees it.

Communication happens only on the last micro-batch of a step, which the caller
announces per model chunk with `set_last_microbatch(chunk, is_last)` before each
backward. During that backward, each bucket counts its parameters' hooks; when the
last one fires, the bucket's collective starts at once (async), while autograd goes
on computing earlier layers' gradients:

- sharded modes: reduce-scatter (a SUM: the loss is already normalised by the
  global token count), so DP rank r ends up with the summed shard r in place;
- `ddp`: all-reduce (SUM) of the whole bucket.

The reduce-scatter primitive is picked per backend. NCCL (and anything else) uses
the native `reduce_scatter_tensor`. gloo's native reduce-scatter moves as many
bytes as a full all-reduce (measured, 20 MB bucket, DP=2, 1 Gbit/s loopback: 363 ms
vs 326 ms for all-reduce, 170 ms for all-gather, 166 ms for the all-to-all below),
which made the sharded modes pay 1.5x DDP's traffic. On gloo the bucket is therefore
reduce-scattered as an async `all_to_all_single` (rank r receives every rank's copy
of shard r: (DP-1)/DP of the bucket, the optimal reduce-scatter volume) into a
receive buffer, and `wait()` sums the DP copies, in rank order, into the owned
shard of `main_grad`. Receive buffers come from a small pool of largest-bucket-sized
tensors that lives as long as the optimizer: a fresh multi-MB tensor per bucket
per step is fresh pages for the kernel to fault in and zero, which measured 0.6-0.9
s of CPU per rank per step for 240 MB of gradients (vs 0.1 s with reused buffers),
stolen from the backward it should hide behind. Each launch first retires the
reductions that have already completed (sum, buffer back to the pool), so the pool
holds about as many buffers as the network has buckets in flight.

In the `distributed` mode nothing is launched by hooks: `finish()` runs all
reductions after backward, which is Megatron's non-overlapped behaviour. `finish()`
also launches buckets that never became ready (parameters without gradients this
step), then waits only for what is still in flight. With NCCL, `async_op=True`
collectives run on NCCL's own communication stream (the side stream) and `wait()`
makes the compute stream wait for them, so compute is never blocked by the launch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.comm import reduce_scatter_flat
from .buffers import Bucket, BufferGroup


class GradSync:
    def __init__(self, groups: list[BufferGroup], num_chunks: int, mode: str, dp_group, dp: int, dp_rank: int):
        self.groups, self.mode, self.dp_group, self.dp, self.dp_rank = groups, mode, dp_group, dp, dp_rank
        self.buckets: list[Bucket] = [b for g in groups for b in g.buckets]
        self.is_last = [True] * num_chunks  # a step with a single backward needs no announcement
        self._ready = [0] * len(self.buckets)
        self._handles: dict[int, object] = {}
        self._hooks = []
        self._gloo = dp > 1 and dist.get_backend(dp_group) == "gloo"
        self._pool = _ScratchPool(max(b.grad_buf.numel() for b in self.buckets)) if self._gloo else None
        for b in self.buckets:
            for s in b.slots:
                if s.param.dtype == s.param.main_grad.dtype:
                    s.param.grad = s.param.main_grad
                self._hooks.append(s.param.register_post_accumulate_grad_hook(self._hook(b)))

    def set_last_microbatch(self, chunk_index: int, is_last: bool) -> None:
        """Announce whether the next backward of chunk `chunk_index` is its last micro-batch of the step."""
        self.is_last[chunk_index] = is_last

    def _hook(self, bucket: Bucket):
        def hook(p):
            if p.grad.data_ptr() != p.main_grad.data_ptr():
                p.main_grad.add_(p.grad)
                p.grad = p.main_grad if p.dtype == p.main_grad.dtype else None
            if not self.is_last[bucket.chunk]:
                return
            if bucket.index in self._handles:
                raise RuntimeError(
                    f"gradient of {_name(bucket, p)} arrived after bucket {bucket.index} was reduced: call "
                    "set_last_microbatch(chunk, False) before every backward but the step's last"
                )
            self._ready[bucket.index] += 1
            if self._ready[bucket.index] == len(bucket.slots) and self.mode != "distributed":
                self._launch(bucket)

        return hook

    def _launch(self, bucket: Bucket) -> None:
        if self._pool is not None:
            for h in self._handles.values():  # retire finished reductions, freeing their buffers
                if isinstance(h, _AllToAllReduceScatter) and h.done():
                    h.wait()
        self._handles[bucket.index] = self._collective(bucket) if self.dp > 1 else None

    def _collective(self, bucket: Bucket):
        if self.mode == "ddp":
            return dist.all_reduce(bucket.grad_buf, group=self.dp_group, async_op=True)
        out = bucket.shard(bucket.grad_buf, self.dp_rank)
        if self._gloo:
            return _AllToAllReduceScatter(out, bucket.grad_buf, self.dp, self.dp_group, self._pool)
        return reduce_scatter_flat(out, bucket.grad_buf, group=self.dp_group, async_op=True)

    def finish(self) -> None:
        """Launch what has not been launched yet, then wait for everything (call once per step)."""
        for b in self.buckets:
            if b.index not in self._handles:
                self._launch(b)
        for h in self._handles.values():
            if h is not None:
                h.wait()

    def reset(self) -> None:
        """Zero the main grads and forget this step's launches (after the update)."""
        for g in self.groups:
            g.grad_buffer.zero_()
        self._handles.clear()
        self._ready = [0] * len(self.buckets)
        self.is_last = [True] * len(self.is_last)
        for b in self.buckets:
            for s in b.slots:
                if s.param.dtype == s.param.main_grad.dtype:
                    s.param.grad = s.param.main_grad

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


class _ScratchPool:
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

    def __init__(self, out: torch.Tensor, full: torch.Tensor, dp: int, group, pool: _ScratchPool):
        self.out, self.dp, self.pool = out, dp, pool
        # recv[r * shard : (r + 1) * shard] = DP rank r's copy of our shard
        self.recv, self._flat = pool.take(full)
        self.work = dist.all_to_all_single(self.recv, full, group=group, async_op=True)

    def done(self) -> bool:
        return self.recv is None or self.work.is_completed()

    def wait(self) -> None:
        if self.recv is None:  # already summed
            return
        self.work.wait()
        torch.sum(self.recv.view(self.dp, -1), dim=0, out=self.out)
        self.pool.give(self._flat)
        self.recv = self._flat = None


def _name(bucket: Bucket, p) -> str:
    return next((s.name for s in bucket.slots if s.param is p), "a parameter")
