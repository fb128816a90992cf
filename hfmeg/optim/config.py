"""`OptimizerConfig`: the one source of truth for the optimizer and gradient sync.

Which parameters are excluded from weight decay is decided here, from each
parameter's role (`hfmeg.parallel.roles`), so the distributed optimizer and any
single-process reference (tests, tools) use the same rule: `no_weight_decay(role, cfg)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ..errors import UnsupportedConfigError
from ..parallel.data_parallel import MODES
from ..parallel.roles import ParamRole


@dataclass
class OptimizerConfig:
    """AdamW hyper-parameters plus how gradients and state are distributed.

    mode:
      - `ddp`: gradients all-reduced bucket by bucket during backward, optimizer replicated;
      - `distributed`: state sharded over DP, reduce-scatter after backward and
        all-gather after the update, both in series with compute (Megatron's
        DistributedOptimizer; the in-house anchor);
      - `overlapped`: state sharded, reduce-scatter started bucket by bucket during the
        last micro-batch's backward, all-gather waited bucket by bucket in the next forward.

    compression `powersgd` (any mode; hfmeg.parallel.powersgd): from step
    `compression_start_step` on (counted from 0), DP gradient sums of matrices are sent as
    rank-`powersgd_rank` factors with error feedback. The steps before take the exact
    path: Adam's second moment needs exact gradients first. None: 10 % of
    train.max_steps, filled in by TrainConfig; a bare OptimizerConfig must set it.
    """

    mode: Literal["ddp", "distributed", "overlapped"] = "overlapped"
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    no_decay_norms: bool = True
    no_decay_biases: bool = True
    no_decay_embeddings: bool = False  # embed.weight, pos_embed.weight, lm_head.weight (role kind `embedding`)
    bucket_size: int = 40_000_000  # elements per gradient bucket (before DP padding)
    # Layers write weight gradients straight into the fp32 main grads (hfmeg.parallel.wgrad); off: autograd + hooks.
    grad_accumulation_fusion: bool = True
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping (the norm is still computed)
    impl: Literal["foreach", "fused"] = "fused"  # torch.optim.AdamW implementation (fused: one pass, 4x foreach on CPU)
    # fp16 dynamic loss scaling (used only when the model has fp16 parameters)
    initial_loss_scale: float = 2.0**16
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000  # overflow-free steps before the scale doubles
    compression: Literal["none", "powersgd"] = "none"
    powersgd_rank: int = 4
    compression_start_step: int | None = None
    min_compression_rate: float = 2.0  # compress an m x n gradient only if m*n / (rank*(m+n)) >= this
    # DeepSeek-V3's aux-loss-free balancing (models/routing.py): after each step every expert's correction bias
    # moves by this times sign(mean load - its load); 0 keeps the checkpoint's biases. Models without one ignore it.
    router_bias_update_rate: float = 1e-3

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UnsupportedConfigError(f"optimizer field mode: {self.mode!r} is not one of {list(MODES)}")
        if self.impl not in ("foreach", "fused"):
            raise UnsupportedConfigError(f"optimizer field impl: {self.impl!r} is not 'foreach' or 'fused'")
        if self.bucket_size < 1:
            raise UnsupportedConfigError(f"optimizer field bucket_size: must be >= 1, got {self.bucket_size}")
        if self.grad_clip < 0:
            raise UnsupportedConfigError(f"optimizer field grad_clip: must be >= 0, got {self.grad_clip}")
        if not (0 < self.min_loss_scale <= self.initial_loss_scale):
            raise UnsupportedConfigError("optimizer field min_loss_scale: must be in (0, initial_loss_scale]")
        if self.compression not in ("none", "powersgd"):
            raise UnsupportedConfigError(f"optimizer field compression: {self.compression!r} is not 'none' or "
                                         "'powersgd'")
        if self.powersgd_rank < 1:
            raise UnsupportedConfigError(f"optimizer field powersgd_rank: must be >= 1, got {self.powersgd_rank}")
        if self.compression_start_step is not None and self.compression_start_step < 0:
            raise UnsupportedConfigError("optimizer field compression_start_step: must be >= 0, got "
                                         f"{self.compression_start_step}")
        if not (math.isfinite(self.router_bias_update_rate) and self.router_bias_update_rate >= 0):
            raise UnsupportedConfigError("optimizer field router_bias_update_rate: must be a finite number >= 0, got "
                                         f"{self.router_bias_update_rate}")
        if not (math.isfinite(self.min_compression_rate) and self.min_compression_rate >= 0):
            raise UnsupportedConfigError("optimizer field min_compression_rate: must be a finite number >= 0, got "
                                         f"{self.min_compression_rate}")

    @property
    def sharded(self) -> bool:
        return self.mode != "ddp"


def no_weight_decay(role: ParamRole, cfg: OptimizerConfig) -> bool:
    """True when a parameter with `role` is excluded from weight decay (a norm's bias is both a norm and a bias)."""
    kind = role.kind
    return (cfg.no_decay_norms and kind in ("norm", "norm_bias")) \
        or (cfg.no_decay_biases and kind in ("bias", "norm_bias")) \
        or (cfg.no_decay_embeddings and kind == "embedding")
