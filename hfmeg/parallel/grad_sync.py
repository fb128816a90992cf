"""Gradient accumulation into the main-grad buffer and the bucketed DP reduction.

A parameter's gradient reaches its fp32 `main_grad` one of two ways:
- fused (wgrad.py; weights of the linear layers, embeddings, LM heads and grouped experts):
  the layer's backward adds it into the `grad_sink` this wrapper gave the parameter (its
  `main_grad`) and hands autograd no gradient;
- through autograd (norms, biases, adapters): for parameters whose dtype matches the
  main-grad buffer, `param.grad` *is* the `main_grad` view, so autograd adds in place;
  otherwise (bf16/fp16 parameters) the hook adds `param.grad` into the fp32 `main_grad` and
  frees it.
Either way autograd runs the parameter's post-accumulate-grad hook once per backward, after
the parameter's last use (with no gradient when fused), and the hook does the bucket
accounting below.

Communication happens only on the last micro-batch of a step, which the caller
announces per model chunk with `set_last_microbatch(chunk, is_last)` before each
backward. During that backward, each bucket counts its parameters' hooks; when the
last one fires, the bucket's collective starts at once (async), while autograd goes
on computing earlier layers' gradients:

- sharded modes: reduce-scatter (a SUM: the loss is already normalised by the
  global token count), so DP rank r ends up with the summed shard r in place;
- `ddp`: all-reduce (SUM) of the whole bucket.

Each bucket is summed over its own group (`sum_group(bucket)`): the DP group, or the
expert-DP group for experts' buckets under expert parallelism. Each group sees its
buckets in the same order on all its ranks, which is all the collectives need.

The reduce-scatter itself, and why gloo gets its own, is in bucket_comm.py. On gloo
each launch first retires the reductions that have already completed (sum, receive
buffer back to the pool), so the pool holds about as many buffers as the network
has buckets in flight.

With PowerSGD on (`compress`, set per step by the optimizer), a bucket holding a
matrix worth compressing is launched through the compressor instead (powersgd.py:
two rounds of small all-reduces, the second started at the next launch); after the
update its compressed gradients are set to their residuals rather than zeroed.

In the `distributed` mode nothing is launched by hooks: `finish()` runs all
reductions after backward, which is Megatron's non-overlapped behaviour. `finish()`
also launches buckets that never became ready (parameters without gradients this
step), then waits only for what is still in flight.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch.distributed as dist

from .bucket_comm import ScratchPool, SumGroup, is_gloo, reduce_scatter_async
from .buffers import Bucket, BufferGroup
from .powersgd import PowerSGD


class GradSync:
    def __init__(self, groups: list[BufferGroup], num_chunks: int, mode: str, sum_group: Callable[[Bucket], SumGroup],
                 compressor: PowerSGD | None = None, fuse_wgrad: bool = True):
        self.groups, self.mode, self.sum_group = groups, mode, sum_group
        self.compressor = compressor
        self.compress = False  # this step's DP sums go through `compressor`
        self.buckets: list[Bucket] = [b for g in groups for b in g.buckets]
        self.is_last = [True] * num_chunks  # a step with a single backward needs no announcement
        self._ready = [0] * len(self.buckets)
        self._handles: dict[int, object] = {}
        self._hooks = []
        summed = [self.sum_group(b) for b in self.buckets]
        gloo = mode != "ddp" and any(g.size > 1 and is_gloo(g.group) for g in summed)  # ddp reduces in place
        self._pool = ScratchPool(max(b.grad_buf.numel() for b in self.buckets)) if gloo else None
        for b in self.buckets:
            for s in b.slots:
                if s.param.dtype == s.param.main_grad.dtype:
                    s.param.grad = s.param.main_grad
                self._hooks.append(s.param.register_post_accumulate_grad_hook(self._hook(b)))
                if fuse_wgrad:
                    s.param.grad_sink = s.param.main_grad

    def set_last_microbatch(self, chunk_index: int, is_last: bool) -> None:
        """Announce whether the next backward of chunk `chunk_index` is its last micro-batch of the step."""
        self.is_last[chunk_index] = is_last

    def _hook(self, bucket: Bucket):
        # The hook lives on the parameter, in C++, where Python's garbage collector cannot see it: a strong
        # reference from it to this object (whose buckets hold the parameters) would be a cycle nothing frees,
        # keeping every model a process ever wrapped alive. So it holds a weak reference and a bucket index.
        owner, index = weakref.ref(self), bucket.index

        def hook(p):
            sync = owner()
            if sync is not None:
                sync._on_grad(sync.buckets[index], p)

        return hook

    def _on_grad(self, bucket: Bucket, p) -> None:
        if p.grad is not None and p.grad.data_ptr() != p.main_grad.data_ptr():  # None: fused, already there
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

    def _launch(self, bucket: Bucket) -> None:
        if self._pool is not None:
            for h in self._handles.values():  # retire finished reductions, freeing their buffers
                if h is not None and h.is_completed():
                    h.wait()
        if self.compress:
            self.compressor.advance()
        g = self.sum_group(bucket)
        self._handles[bucket.index] = self._collective(bucket, g) if g.size > 1 else None

    def _collective(self, bucket: Bucket, g: SumGroup):
        if self.compress and self.compressor.compresses(bucket):
            return self.compressor.launch(bucket)
        if self.mode == "ddp":
            return dist.all_reduce(bucket.grad_buf, group=g.group, async_op=True)
        return reduce_scatter_async(bucket.shard(bucket.grad_buf, g.rank), bucket.grad_buf, g.group, self._pool)

    def finish(self) -> None:
        """Launch what has not been launched yet, then wait for everything (call once per step)."""
        for b in self.buckets:
            if b.index not in self._handles:
                self._launch(b)
        for h in self._handles.values():
            if h is not None:
                h.wait()

    def reset(self) -> None:
        """Zero the main grads (compressed ones: their residuals) and forget this step's launches (after the update)."""
        if self.compress:
            for b in self.buckets:
                if self.compressor.compresses(b):
                    self.compressor.keep_residuals(b)
                else:
                    b.grad_buf.zero_()
        else:
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
        for b in self.buckets:
            for s in b.slots:
                if hasattr(s.param, "grad_sink"):
                    del s.param.grad_sink


def _name(bucket: Bucket, p) -> str:
    return next((s.name for s in bucket.slots if s.param is p), "a parameter")
