"""Graceful stop on SIGTERM / SIGINT: finish the step, save a checkpoint, exit cleanly.

The handler only sets a flag. Ranks may receive the signal at different times (or
only some of them, e.g. one node's scheduler), so the loop asks `should_stop()`,
which agrees across the world with one MAX all-reduce of a single int per step.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class GracefulStop:
    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
        self.requested = False
        self.signal_name: str | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in signals}

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def should_stop(self, device: torch.device) -> bool:
        flag = torch.tensor([int(self.requested)], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
