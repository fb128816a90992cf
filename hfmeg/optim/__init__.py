"""Overlapped distributed optimizer, gradient clipping, loss scaling, LR schedules."""

from .config import OptimizerConfig, no_weight_decay
from .distributed_optimizer import DistributedOptimizer, StepResult

__all__ = ["DistributedOptimizer", "OptimizerConfig", "StepResult", "no_weight_decay"]
