"""The (overlapped) distributed optimizer: sharded fp32 master weights and AdamW moments.

Life of one step (mode `overlapped`; see `OptimizerConfig` for the others):

1. Backward of the last micro-batch: `GradSync` hooks start each bucket's async
   reduce-scatter as soon as its last gradient lands (grad_sync.py).
2. `step()` waits only for the reductions still in flight, then sums the owned
   shard of sequence-parallel parameters over TP and of the tied embedding over the
   embedding group (first + last stage), unscales (fp16), computes the global norm
   (clip.py); a non-finite norm skips the step (counted, logged, loss scale backed off).
3. Clip, then update bucket by bucket in forward order (the first stage's
   embedding first). Each bucket has its own `torch.optim.AdamW` (foreach or fused)
   over this rank's fp32 master shard of the bucket. The AdamW "parameters" are
   views of one flat master tensor, one per contiguous run of elements that share a
   weight-decay setting, so a weight-decay exclusion that straddles a shard
   boundary is honoured on both sides; the moments are views of two flat tensors
   laid out the same way. (One optimizer for all buckets would compute the same
   numbers, but only all at once.)
4. As soon as a bucket is updated, its new master shard is cast into the parameter
   buffer and its all-gather is launched asynchronously, so the bucket the next
   forward needs first is in flight while the later buckets are still being
   updated. Pre-forward hooks on each module that owns parameters wait for that
   module's buckets, so the next forward blocks bucket by bucket, only when it
   reaches weights still in flight. (`lm_head`, whose weight `ModelChunk._head`
   reads right after `final_norm` without calling `lm_head.forward`, is waited for
   at `final_norm`.) Readers outside a forward (saving a checkpoint) wait for
   all of a chunk's buckets through the chunk's "parameters ready" barrier
   (parallel/params_ready.py). Mode `distributed` keeps Megatron's serial order instead:
   every bucket is updated first, then all buckets are all-gathered and waited
   for inside `step()`, so no communication overlaps any compute.

The object also answers the pipeline schedules' `set_last_microbatch(chunk, is_last)`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.comm import all_reduce_coalesced
from ..parallel.params_ready import set_params_barrier
from ..parallel.state import ParallelState
from .bucket_comm import all_gather_async
from .buffers import Bucket, build_groups
from .clip import clip_coefficient, global_norm
from .config import OptimizerConfig, no_weight_decay
from .grad_sync import GradSync
from .loss_scale import DynamicLossScaler

log = logging.getLogger("hfmeg.optim")


@dataclass
class StepResult:
    grad_norm: float  # before clipping, after unscaling; inf/nan when the step was skipped
    skipped: bool
    loss_scale: float


def _runs(bucket: Bucket, rank: int, key) -> list[tuple[int, int, object]]:
    """Owned-shard ranges [lo, hi) of consecutive parameters with equal `key(slot)`, merged."""
    base = rank * bucket.shard_size
    runs: list[list] = []
    for slot, lo, hi in bucket.segments(rank):
        a, b, k = slot.offset + lo - base, slot.offset + hi - base, key(slot)
        if runs and runs[-1][2] == k and runs[-1][1] == a:
            runs[-1][1] = b
        else:
            runs.append([a, b, k])
    return [tuple(r) for r in runs]


class DistributedOptimizer:
    def __init__(self, chunks: list[nn.Module], ps: ParallelState, cfg: OptimizerConfig):
        self.chunks, self.ps, self.cfg = list(chunks), ps, cfg
        self.shards = ps.dp if cfg.sharded else 1
        self.rank = ps.dp_rank if cfg.sharded else 0
        self.groups = build_groups(self.chunks, ps.pp, cfg.bucket_size, self.shards)
        self.buckets = [b for g in self.groups for b in g.buckets]
        self.grad_sync = GradSync(self.groups, len(self.chunks), cfg.mode, ps.dp_group, ps.dp, ps.dp_rank)
        device = self.groups[0].param_buffer.device

        # Flat fp32 state for the owned shards, bucket after bucket.
        self.offsets: dict[int, int] = {}
        total = 0
        for b in self.buckets:
            self.offsets[b.index] = total
            total += b.shard_size
        self.master = torch.empty(total, dtype=torch.float32, device=device)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        for b in self.buckets:
            self._master_shard(b).copy_(self._own(b, b.param_buf))

        self._norm_grads, self._sp_grads = [], []
        # Forward order: chunk by chunk, and inside a chunk the reverse of gradient-ready order.
        self._forward_order = sorted(self.buckets, key=lambda b: (b.chunk, -b.index))
        self.optimizers: dict[int, torch.optim.AdamW] = {}  # bucket index -> AdamW over its owned shard
        for b in self._forward_order:
            grad = self._own(b, b.grad_buf)
            for lo, hi, ok in _runs(b, self.rank, lambda s: s.role.counted_on(ps.tp_rank)):
                if ok:
                    self._norm_grads.append(grad[lo:hi])
            if ps.sequence_parallel:
                for lo, hi, sp in _runs(b, self.rank, lambda s: s.role.sequence_parallel):
                    if sp:
                        self._sp_grads.append(grad[lo:hi])
            adamw = self._bucket_adamw(b, grad)
            if adamw is not None:
                self.optimizers[b.index] = adamw
        self._shard_grads = [self._own(b, b.grad_buf) for b in self.buckets]

        fp16 = any(g.dtype == torch.float16 for g in self.groups)
        self.scaler = DynamicLossScaler(cfg.initial_loss_scale, cfg.min_loss_scale, cfg.loss_scale_window) \
            if fp16 else None
        self.skipped_steps = 0
        self._pending: dict[int, object] = {}  # bucket index -> in-flight parameter all-gather
        self._register_forward_hooks()
        for c, chunk in enumerate(self.chunks):  # readers outside a forward (checkpoint saving) wait here
            mine = [b.index for b in self._forward_order if b.chunk == c]
            set_params_barrier(chunk, lambda mine=mine: self.wait_params(mine))

    def _bucket_adamw(self, b: Bucket, grad: torch.Tensor) -> torch.optim.AdamW | None:
        """torch AdamW over the owned shard of `b` (None when the shard is all padding)."""
        cfg, off = self.cfg, self.offsets[b.index]
        decay, no_decay = [], []
        for lo, hi, nd in _runs(b, self.rank, lambda s: no_weight_decay(s.role, cfg)):
            p = self.master[off + lo : off + hi]
            p.grad = grad[lo:hi]
            (no_decay if nd else decay).append((p, off + lo, off + hi))
        groups = [{"params": [p for p, _, _ in decay]}, {"params": [p for p, _, _ in no_decay], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        if not groups:
            return None
        adamw = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                  weight_decay=cfg.weight_decay,
                                  fused=cfg.impl == "fused", foreach=cfg.impl == "foreach")
        step_device = self.master.device if cfg.impl == "fused" else torch.device("cpu")
        for p, lo, hi in decay + no_decay:
            # Moments live in flat tensors (for checkpoints and memory accounting); AdamW sees views.
            adamw.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=step_device),
                              "exp_avg": self.exp_avg[lo:hi], "exp_avg_sq": self.exp_avg_sq[lo:hi]}
        return adamw

    def adam_states(self) -> list[dict]:
        """Per-parameter AdamW state dicts (`step`, `exp_avg`, `exp_avg_sq`) of every bucket."""
        return [st for adamw in self.optimizers.values() for st in adamw.state.values()]

    # -- layout helpers --------------------------------------------------------------
    def _own(self, b: Bucket, buf: torch.Tensor) -> torch.Tensor:
        return b.shard(buf, self.rank)

    def _master_shard(self, b: Bucket) -> torch.Tensor:
        off = self.offsets[b.index]
        return self.master[off : off + b.shard_size]

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (fp32 master + both Adam moments)."""
        return sum(t.numel() * t.element_size() for t in (self.master, self.exp_avg, self.exp_avg_sq))

    # -- the trainer / schedule interface ----------------------------------------------
    def set_last_microbatch(self, chunk_index: int, is_last: bool) -> None:
        self.grad_sync.set_last_microbatch(chunk_index, is_last)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale if self.scaler is not None else loss

    def set_lr(self, lr: float) -> None:
        for adamw in self.optimizers.values():
            for g in adamw.param_groups:
                g["lr"] = lr

    def zero_grad(self) -> None:
        """Drop this step's gradients (the step does this itself)."""
        self.grad_sync.finish()
        self.grad_sync.reset()

    def step(self) -> StepResult:
        self.wait_params()  # a step without a forward in between must not race the last all-gather
        self.grad_sync.finish()
        self._sync_replicas()
        if self.scaler is not None:
            torch._foreach_mul_(self._shard_grads, 1.0 / self.scaler.scale)
        ps = self.ps
        group = None if self.cfg.sharded else ps.mp_group  # world = DP x model-parallel
        reduce = ps.world_size > 1 if self.cfg.sharded else ps.tp * ps.pp > 1
        norm = global_norm(self._norm_grads, group, reduce, self.master.device)
        skipped = not math.isfinite(norm)
        scale = self.loss_scale
        if self.scaler is not None:
            self.scaler.update(skipped)
        if skipped:
            self.skipped_steps += 1
            log.warning("non-finite gradient norm (%s) at loss scale %g: step skipped (%d so far)",
                        norm, scale, self.skipped_steps)
        else:
            coef = clip_coefficient(norm, self.cfg.grad_clip)
            if coef < 1.0:
                torch._foreach_mul_(self._shard_grads, coef)
            serial = self.cfg.mode == "distributed"
            for b in self._forward_order:
                if b.index in self.optimizers:
                    self.optimizers[b.index].step()
                if not serial:
                    self._publish(b)
            if serial:  # Megatron's order: the whole update, then the all-gathers, waited here
                self.publish_params()
        self.grad_sync.reset()
        return StepResult(norm, skipped, scale)

    # -- step internals ------------------------------------------------------------------
    def _sync_replicas(self) -> None:
        """Sum sequence-parallel grads over TP and tied-embedding grads over the embedding group."""
        ps = self.ps
        if self._sp_grads and ps.tp > 1:
            all_reduce_coalesced(self._sp_grads, ps.tp_group)
        for b in self.buckets:
            if b.isolated:  # only exists when PP > 1 and embeddings are tied (buffers.py)
                dist.all_reduce(self._own(b, b.grad_buf), group=ps.embedding_group)

    def publish_params(self) -> None:
        """Cast every master shard into the parameter buffers and all-gather them over DP, in forward order."""
        for b in self._forward_order:
            self._publish(b)
        if self.cfg.mode == "distributed":
            self.wait_params()

    def _publish(self, b: Bucket) -> None:
        """Cast the master shard of `b` into its parameter buffer and launch the bucket's async all-gather."""
        self._own(b, b.param_buf).copy_(self._master_shard(b))
        if self.shards > 1:
            self._pending[b.index] = all_gather_async(b.param_buf, self._own(b, b.param_buf), self.ps.dp_group,
                                                      tag=b.index)

    def wait_params(self, buckets: list[int] | None = None) -> None:
        """Wait for the parameter all-gathers of `buckets` (default: all still in flight)."""
        for i in (sorted(self._pending, key=lambda i: (self.buckets[i].chunk, -i)) if buckets is None else buckets):
            h = self._pending.pop(i, None)
            if h is not None:
                h.wait()

    def _register_forward_hooks(self) -> None:
        bucket_of = {id(s.param): b.index for b in self.buckets for s in b.slots}
        self._forward_hooks = []
        for chunk in self.chunks:
            points: list[tuple[nn.Module, set[int]]] = []
            for name, module in chunk.named_modules():
                ids = {bucket_of[id(p)] for p in module.parameters(recurse=False) if id(p) in bucket_of}
                if not ids:
                    continue
                if name == "lm_head" and points:
                    points[-1][1].update(ids)
                else:
                    points.append((module, ids))
            for module, ids in points:
                wanted = sorted(ids, reverse=True)
                self._forward_hooks.append(
                    module.register_forward_pre_hook(lambda _m, _a, wanted=wanted: self.wait_params(wanted)))
