"""The (overlapped) distributed optimizer: sharded fp32 master weights and AdamW moments.

The optimizer owns only optimizer state; the model-side `DataParallel` wrapper
(parallel/data_parallel.py, built here from the same `OptimizerConfig`) owns the
parameter and gradient buffers and every collective. Life of one step (mode
`overlapped`; see `OptimizerConfig` for the others):

1. Backward of the last micro-batch: the wrapper's hooks start each bucket's async
   reduce-scatter as soon as its last gradient lands (parallel/grad_sync.py).
2. `step()` asks the wrapper to finish the gradients (`finish_grad_sync`: DP,
   sequence-parallel and tied-embedding sums), unscales (fp16), computes the global
   norm (clip.py); a non-finite norm skips the step (counted, logged, loss scale
   backed off).
3. Clip, then update bucket by bucket in forward order (the first stage's
   embedding first). Each bucket has its own `torch.optim.AdamW` (foreach or fused)
   over this rank's fp32 master shard of the bucket. The AdamW "parameters" are
   views of one flat master tensor, one per contiguous run of elements that share a
   weight-decay setting, so a weight-decay exclusion that straddles a shard
   boundary is honoured on both sides; the moments are views of two flat tensors
   laid out the same way. (One optimizer for all buckets would compute the same
   numbers, but only all at once.)
4. As soon as a bucket is updated, its new master shard is cast into the parameter
   buffer and the wrapper launches its all-gather, so the bucket the next forward
   needs first is in flight while the later buckets are still being updated; the
   next forward waits bucket by bucket in the wrapper's pre-forward hooks. Mode
   `distributed` keeps Megatron's serial order instead: every bucket is updated
   first, then all buckets are all-gathered and waited for inside `step()`, so no
   communication overlaps any compute.

The object also answers the pipeline schedules' `set_last_microbatch(chunk, is_last)`.
It counts its steps (`iteration`, skipped ones included, saved with its state) and,
with `compression: powersgd`, switches the wrapper's compression on from
`compression_start_step`; a skipped step restarts the compression state.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import UnsupportedConfigError
from ..models.routing import update_score_biases
from ..parallel.buffers import Bucket
from ..parallel.data_parallel import DataParallel
from ..parallel.state import ParallelState
from .clip import clip_coefficient, global_norm
from .config import OptimizerConfig, no_weight_decay
from .loss_scale import DynamicLossScaler

log = logging.getLogger("hfmeg.optim")


@dataclass
class StepResult:
    grad_norm: float  # before clipping, after unscaling; inf/nan when the step was skipped
    skipped: bool
    loss_scale: float


class DistributedOptimizer:
    def __init__(self, chunks: list[nn.Module], ps: ParallelState, cfg: OptimizerConfig):
        self.chunks, self.ps, self.cfg = list(chunks), ps, cfg
        # DeepSeek-V3's correction biases move after each step (models/routing.py); a collective on every rank.
        moe = getattr(getattr(self.chunks[0], "cfg", None), "moe", None)
        self.balances_routers = moe is not None and moe.score_correction_bias
        powersgd = cfg.compression == "powersgd"
        if powersgd and cfg.compression_start_step is None:
            raise UnsupportedConfigError("optimizer field compression_start_step: must be set with compression "
                                         "powersgd (TrainConfig derives it from train.max_steps)")
        self.data_parallel = dp = DataParallel(self.chunks, ps, cfg.mode, cfg.bucket_size,
                                               cfg.powersgd_rank if powersgd else None, cfg.min_compression_rate,
                                               cfg.grad_accumulation_fusion)
        self.shards, self.groups, self.buckets = dp.shards, dp.groups, dp.buckets
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

        # The global norm counts each element once (clip.py). Sharded: every rank its owned shards, summed
        # over the world. ddp: every replica holds everything and the model-parallel group sums one
        # replica's; with EP no replica holds every expert, so the bucket's primary rank counts it, over the world.
        per_replica = not cfg.sharded and ps.ep == 1
        self._norm_group = ps.mp_group if per_replica else None
        self._norm_reduce = ps.tp * ps.pp > 1 if per_replica else ps.world_size > 1
        self._norm_grads = []
        self.optimizers: dict[int, torch.optim.AdamW] = {}  # bucket index -> AdamW over its owned shard
        for b in dp.forward_order:
            grad = self._own(b, b.grad_buf)
            # Rows a replicated KV head's holders share count on the first holder only.
            copies = [(lo, hi) for lo, hi, n in b.shared_runs(dp.shard_rank(b)) if ps.tp_rank % n]
            for lo, hi, ok in b.runs(dp.shard_rank(b), lambda s: s.role.counted_on(ps.tp_rank)):
                if ok and (per_replica or dp.primary(b)):
                    self._norm_grads += [grad[a:z] for a, z in _without(lo, hi, copies)]
            adamw = self._bucket_adamw(b, grad)
            if adamw is not None:
                self.optimizers[b.index] = adamw
        self._shard_grads = [self._own(b, b.grad_buf) for b in self.buckets]

        fp16 = any(g.dtype == torch.float16 for g in self.groups)
        if powersgd and fp16:
            raise UnsupportedConfigError("optimizer field compression: powersgd does not support fp16 parameters "
                                         "(residuals would keep a stale loss scale); use bf16 or fp32")
        self.scaler = DynamicLossScaler(cfg.initial_loss_scale, cfg.min_loss_scale, cfg.loss_scale_window) \
            if fp16 else None
        self.skipped_steps = 0
        self.set_iteration(0)

    def _bucket_adamw(self, b: Bucket, grad: torch.Tensor) -> torch.optim.AdamW | None:
        """torch AdamW over the owned shard of `b` (None when the shard is all padding)."""
        cfg, off = self.cfg, self.offsets[b.index]
        decay, no_decay = [], []
        for lo, hi, nd in b.runs(self.data_parallel.shard_rank(b), lambda s: no_weight_decay(s.role, cfg)):
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
        return self.data_parallel.owned(b, buf)

    def _master_shard(self, b: Bucket) -> torch.Tensor:
        off = self.offsets[b.index]
        return self.master[off : off + b.shard_size]

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (fp32 master + both Adam moments)."""
        return sum(t.numel() * t.element_size() for t in (self.master, self.exp_avg, self.exp_avg_sq))

    def set_iteration(self, iteration: int) -> None:
        """Steps taken so far (a resumed run's count); decides whether the next one is compressed."""
        self.iteration = iteration
        start = self.cfg.compression_start_step
        self.data_parallel.set_compression(self.cfg.compression == "powersgd" and iteration >= start)

    # -- the trainer / schedule interface ----------------------------------------------
    def set_last_microbatch(self, chunk_index: int, is_last: bool) -> None:
        self.data_parallel.set_last_microbatch(chunk_index, is_last)

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
        self.data_parallel.zero_grad()

    def step(self) -> StepResult:
        self.wait_params()  # a step without a forward in between must not race the last all-gather
        self.data_parallel.finish_grad_sync()
        scale = self.loss_scale
        # The norm of the unscaled gradients is the scaled norm / scale: no pass over the gradients to unscale.
        norm = global_norm(self._norm_grads, self._norm_group, self._norm_reduce, self.master.device) / scale
        skipped = not math.isfinite(norm)
        if self.scaler is not None:
            self.scaler.update(skipped)
        if skipped:
            self.skipped_steps += 1
            log.warning("non-finite gradient norm (%s) at loss scale %g: step skipped (%d so far)",
                        norm, scale, self.skipped_steps)
        else:
            self._scale_grads(clip_coefficient(norm, self.cfg.grad_clip) / scale)
            serial = self.cfg.mode == "distributed"
            for b in self.data_parallel.forward_order:
                if b.index in self.optimizers:
                    self.optimizers[b.index].step()
                if not serial:
                    self._publish(b)
            if serial:  # Megatron's order: the whole update, then the all-gathers, waited here
                self.publish_params()
        self.data_parallel.zero_grad()
        if skipped:
            self.data_parallel.drop_compression_state()
        if self.balances_routers:
            update_score_biases(self.chunks, self.ps, 0.0 if skipped else self.cfg.router_bias_update_rate)
        self.set_iteration(self.iteration + 1)
        return StepResult(norm, skipped, scale)

    def _scale_grads(self, factor: float) -> None:
        """Have this step's AdamW see every gradient times `factor` (the clip coefficient over the loss scale).

        The fused AdamW divides each gradient by its `grad_scale` as it reads it (torch's hook for
        GradScaler), so the factor costs no pass over the gradients; the foreach AdamW has no such
        input, and the gradients are multiplied in place first."""
        if self.cfg.impl == "fused":
            # A fill kernel, not a host-to-device copy of a Python float.
            grad_scale = torch.full((), 1.0 / factor, device=self.master.device) if factor != 1.0 else None
            for adamw in self.optimizers.values():
                adamw.grad_scale = grad_scale
        elif factor != 1.0:
            torch._foreach_mul_(self._shard_grads, factor)

    # -- parameters ----------------------------------------------------------------------
    def publish_params(self) -> None:
        """Cast every master shard into the parameter buffers and all-gather them over DP, in forward order."""
        for b in self.data_parallel.forward_order:
            self._publish(b)
        if self.cfg.mode == "distributed":
            self.wait_params()

    def _publish(self, b: Bucket) -> None:
        """Cast the master shard of `b` into its parameter buffer and have the wrapper all-gather it."""
        self._own(b, b.param_buf).copy_(self._master_shard(b))
        self.data_parallel.start_param_gather(b)

    def wait_params(self, buckets: list[int] | None = None) -> None:
        """Wait for the parameter all-gathers of `buckets` (default: all still in flight)."""
        self.data_parallel.wait_params(buckets)


def _without(lo: int, hi: int, cuts: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of [lo, hi) outside every range of `cuts` (sorted, disjoint)."""
    out = []
    for a, z in cuts:
        if a < hi and z > lo:
            if a > lo:
                out.append((lo, a))
            lo = max(lo, z)
    return out + [(lo, hi)] if lo < hi else out
