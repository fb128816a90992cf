"""The model-side data-parallel wrapper: flat buffers, overlapped gradient and parameter sync.

`DataParallel(chunks, ps, mode, bucket_size)` takes over the parameters of a rank's
model chunks (the idea of Megatron's DDP wrapper and of torchtitan's `fully_shard`):

- Buffers (buffers.py): each parameter becomes a view into a flat parameter buffer,
  and gets `main_grad`, a view into a flat fp32 gradient buffer with the same layout,
  cut into buckets in gradient-ready order. In the sharded modes (`distributed`,
  `overlapped`) each bucket splits into DP shards; DP rank r owns shard r.
- Expert parallelism (EP > 1): each EP rank holds other experts, so the routed
  experts' parameters (role `expert`) have buffers and buckets of their own, summed,
  sharded and all-gathered over the expert-data-parallel group (`dp / ep` ranks with
  the same experts) with `edp` shards, where every other bucket uses the DP group
  (`sum_group`). At EP = 1 that group is the DP group, so experts stay in the
  ordinary buckets and nothing changes. PowerSGD compresses each bucket's sum over
  that bucket's group.
- Backward (grad_sync.py): the layers write weight gradients into `main_grad` (`fuse_wgrad`,
  wgrad.py), per-parameter hooks accumulate the rest; on a
  step's last micro-batch, a bucket's reduce-scatter (all-reduce in `ddp`) starts as
  soon as its last gradient lands, while autograd computes earlier layers.
- PowerSGD (powersgd.py), when configured and switched on for a step
  (`set_compression`): buckets holding matrices worth compressing are summed as
  low-rank factors instead, with error feedback; each rank still gets its shard.
- `finish_grad_sync()`, once per step: waits for (or, in `distributed`, runs) the DP
  reductions, then finishes the owned shard from the parameters' roles (roles.py):
  sequence-parallel parameters summed over TP, tied-embedding copies summed over the
  embedding group (each has a bucket of its own, so both stages' shards line up).
- After the update, the optimizer writes each bucket's new owned shard into the
  parameter buffer and calls `start_param_gather(bucket)`: an async all-gather over
  DP (bucket_comm.py). Forward pre-hooks on every module that owns parameters wait
  for that module's buckets, so the next forward blocks only on weights still in
  flight; readers outside a forward (checkpoint saving) wait through the chunk's
  "parameters ready" barrier (params_ready.py).

The model calls every parameterised module (the LM head included), so the hooks need
no knowledge of names. The wrapper answers the pipeline schedules'
`set_last_microbatch(chunk, is_last)`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .bucket_comm import SumGroup, all_gather_async
from .buffers import Bucket, build_groups
from .comm import all_reduce_coalesced, sum_shared_rows
from .grad_sync import GradSync
from .params_ready import is_compiled_block, set_params_barrier
from .powersgd import PowerSGD
from .state import ParallelState

MODES = ("ddp", "distributed", "overlapped")


class DataParallel:
    """`powersgd_rank`: compress DP sums at this rank once `set_compression(True)` (None: never).
    With one DP rank there is nothing to sum, so no compressor is built. `fuse_wgrad`: gradient-
    accumulation fusion (wgrad.py); False leaves every gradient to autograd and the hooks."""

    def __init__(self, chunks: list[nn.Module], ps: ParallelState, mode: str, bucket_size: int,
                 powersgd_rank: int | None = None, min_compression_rate: float = 2.0, fuse_wgrad: bool = True):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.chunks, self.ps, self.mode = list(chunks), ps, mode
        sharded = mode != "ddp"
        # Context-parallel ranks hold partial gradients as DP replicas do: everything sums over DP x CP.
        self.shards = ps.dp_cp if sharded else 1
        self._dense = SumGroup(ps.dp_cp_group, ps.dp_cp, ps.dp_cp_rank)
        self._expert = SumGroup(ps.expert_dp_group, ps.edp, ps.edp_rank)
        expert_shards = (ps.edp if sharded else 1) if ps.ep > 1 else None
        self.groups = build_groups(self.chunks, ps.pp, bucket_size, self.shards, expert_shards=expert_shards)
        self.buckets = [b for g in self.groups for b in g.buckets]
        summed = [b for b in self.buckets if self.sum_group(b).size > 1]  # EP = DP: experts are not summed
        self.compressor = PowerSGD(summed, lambda b: self.sum_group(b).group, self.shard_rank, powersgd_rank,
                                   min_compression_rate) if powersgd_rank is not None and summed else None
        self.grad_sync = GradSync(self.groups, len(self.chunks), mode, self.sum_group, self.compressor, fuse_wgrad)
        # Forward order: chunk by chunk, and inside a chunk the reverse of gradient-ready order.
        self.forward_order = sorted(self.buckets, key=lambda b: (b.chunk, -b.index))
        self._sp_grads = [self.owned(b, b.grad_buf)[lo:hi] for b in self.buckets
                          for lo, hi, sp in b.runs(self.shard_rank(b), lambda s: s.role.sequence_parallel) if sp] \
            if ps.tp > 1 else []
        self._shared_grads = [(self.owned(b, b.grad_buf)[lo:hi], n) for b in self.buckets
                              for lo, hi, n in b.shared_runs(self.shard_rank(b))]
        self._tied = [b for b in self.buckets if b.isolated]  # only when PP > 1 and embeddings are tied
        self._pending: dict[int, object] = {}  # bucket index -> in-flight parameter all-gather
        self._register_forward_hooks()
        for c, chunk in enumerate(self.chunks):
            mine = [b.index for b in self.forward_order if b.chunk == c]
            set_params_barrier(chunk, lambda mine=mine: self.wait_params(mine))

    def sum_group(self, b: Bucket) -> SumGroup:
        """The group that sums bucket `b`'s gradients and shares its shards (see the module docstring)."""
        return self._expert if b.expert else self._dense

    def shard_rank(self, b: Bucket) -> int:
        """Which of `b`'s shards this rank owns (0 in `ddp`: one shard, held whole by every rank)."""
        return self.sum_group(b).rank if b.shards > 1 else 0

    def primary(self, b: Bucket) -> bool:
        """Whether this rank's copy of its shard of `b` is the one that counts (global norm, checkpoints).

        Sharded: every shard has one owner. `ddp`: every rank of the bucket's group holds
        the same whole bucket, and its first rank speaks for them."""
        return self.mode != "ddp" or self.sum_group(b).rank == 0

    def owned(self, b: Bucket, buf: torch.Tensor) -> torch.Tensor:
        """This rank's shard of bucket `b` of `buf` (a bucket's `param_buf` or `grad_buf`)."""
        return b.shard(buf, self.shard_rank(b))

    # -- gradients -----------------------------------------------------------------------
    def set_last_microbatch(self, chunk_index: int, is_last: bool) -> None:
        self.grad_sync.set_last_microbatch(chunk_index, is_last)

    def set_compression(self, on: bool) -> None:
        """Whether the next step's DP sums are compressed (call between steps; no-op without a compressor)."""
        self.grad_sync.compress = on and self.compressor is not None

    def drop_compression_state(self) -> None:
        """After a skipped step: residuals and Q may hold inf/nan, so restart them (no-op while not compressing)."""
        if self.grad_sync.compress:
            self.compressor.reset()

    def finish_grad_sync(self) -> None:
        """Make the owned shard of every bucket the full gradient: DP, then SP and tied-embedding sums."""
        self.grad_sync.finish()
        if self._sp_grads:
            all_reduce_coalesced(self._sp_grads, self.ps.tp_group)
        sum_shared_rows(self._shared_grads, self.ps)  # replicated KV heads' copies (roles.py)
        for b in self._tied:
            dist.all_reduce(self.owned(b, b.grad_buf), group=self.ps.embedding_group)

    def zero_grad(self) -> None:
        """Let every reduction of this step finish, then zero the gradient buffers for the next one."""
        self.grad_sync.finish()
        self.grad_sync.reset()

    # -- parameters ----------------------------------------------------------------------
    def start_param_gather(self, b: Bucket) -> None:
        """Launch the async all-gather of `b`'s parameter buffer (its owned shard is already updated)."""
        if b.shards > 1:
            self._pending[b.index] = all_gather_async(b.param_buf, self.owned(b, b.param_buf),
                                                      self.sum_group(b).group, tag=b.index)

    def wait_params(self, buckets: list[int] | None = None) -> None:
        """Wait for the parameter all-gathers of `buckets` (default: all still in flight)."""
        for i in (sorted(self._pending, key=lambda i: (self.buckets[i].chunk, -i)) if buckets is None else buckets):
            h = self._pending.pop(i, None)
            if h is not None:
                h.wait()

    def _register_forward_hooks(self) -> None:
        """Before a module with parameters runs, wait for its buckets; a compiled block (params_ready.py) waits
        for everything inside it, outside its graph."""
        bucket_of = {id(s.param): b.index for b in self.buckets for s in b.slots}
        for chunk in self.chunks:
            block_of = {id(m): block for block in chunk.modules() if is_compiled_block(block) for m in block.modules()}
            waits: dict[nn.Module, set[int]] = {}  # modules hash by identity
            for module in chunk.modules():
                mine = {bucket_of[id(p)] for p in module.parameters(recurse=False) if id(p) in bucket_of}
                if mine:
                    waits.setdefault(block_of.get(id(module), module), set()).update(mine)
            for owner, mine in waits.items():
                wanted = sorted(mine, reverse=True)
                owner.register_forward_pre_hook(lambda _m, _a, wanted=wanted: self.wait_params(wanted))
