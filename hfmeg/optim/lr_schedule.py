"""Learning-rate schedule: linear warm-up, then cosine or linear decay to `min_lr`.

    step < warmup:                 lr * (step + 1) / warmup
    warmup <= step < total:        min_lr + (lr - min_lr) * f(progress),
                                   progress = (step - warmup) / (total - warmup),
                                   f = (1 + cos(pi * progress)) / 2 (cosine) | 1 - progress (linear) | 1 (constant)
    step >= total:                 min_lr (constant: lr)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ..errors import UnsupportedConfigError


@dataclass
class LRScheduleConfig:
    warmup_steps: int = 0
    total_steps: int | None = None  # warm-up included; None: the run's length (hfmeg.train.config fills it in)
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        if self.decay not in ("cosine", "linear", "constant"):
            raise UnsupportedConfigError(f"lr schedule field decay: {self.decay!r} is not cosine|linear|constant")
        if self.warmup_steps < 0 or (self.total_steps is not None and self.total_steps < 1):
            raise UnsupportedConfigError("lr schedule fields warmup_steps >= 0 and total_steps >= 1 are required")


def lr_at(step: int, lr: float, cfg: LRScheduleConfig) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return lr * (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return lr
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    f = 0.5 * (1.0 + math.cos(math.pi * progress)) if cfg.decay == "cosine" else 1.0 - progress
    return cfg.min_lr + (lr - cfg.min_lr) * f
