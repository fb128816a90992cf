"""How a run stops early: on SIGTERM / SIGINT (gracefully), or when its launcher is gone.

Graceful stop: the handler only records the signal. Ranks may receive it at
different times (or only some of them, e.g. one node's scheduler), so the loop asks
`should_stop()`, which agrees across the world with one MAX all-reduce of the signal's
number per step; the run then saves a checkpoint and exits with 128 + that number
(130 for Ctrl-C's SIGINT, 143 for SIGTERM), on every rank and whatever launched it, so
that `&&` chains and schedulers do not read a stopped run as a finished one. The handler
is held from the trainer's start to its end, so a Ctrl-C during start-up or the export
is no KeyboardInterrupt traceback either.

A signal that finds a peer gone (a launcher stops the other workers once one has died)
cannot be agreed on: the collective fails. The trainer then leaves at once with one line
(`Trainer._leave`) rather than wait for the heartbeat's verdict, which the launcher would
cut short with SIGKILL.

Launcher gone: a worker whose launcher (torchrun, accelerate, `launch.spawn`) was
killed with SIGKILL is re-parented and would go on training and writing checkpoints
as an orphan, colliding with the next run on the same `--out`. On Linux the kernel
kills such a worker at once (`PR_SET_PDEATHSIG`); elsewhere, and as a second line,
the loop compares the parent pid at every step boundary and stops without saving.
A run started by plain `python` (no launcher) is left alone: its parent is a shell,
and a `nohup` run must survive that shell.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import torch
import torch.distributed as dist

from ..errors import HfmegError

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class GracefulStop:
    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
        self.signum = 0  # the signal received (0: none); after `should_stop`, the one agreed on
        self._previous = {s: signal.signal(s, self._handle) for s in signals}

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum != 0

    @property
    def signal_name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum else None

    @property
    def exit_code(self) -> int:
        """A stopped process's exit status, as a shell reports a process a signal ended."""
        return 128 + self.signum

    def should_stop(self, device: torch.device) -> bool:
        """Collective: whether any rank received a signal; every rank then holds the same one."""
        flag = torch.tensor([self.signum], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.signum = int(flag.item())
        return self.requested

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def exit_together() -> None:
    """Every rank found the same error and exits 2 itself: from here SIGTERM is ignored, since a launcher
    (torchrun, accelerate) terminates the other workers as soon as one exits, which would make them die by a
    signal, with the launcher's report of it, instead of exiting 2 (and rank 0 perhaps before its line)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class LauncherGone(HfmegError):
    """The process that launched this worker has died; the worker stops without writing."""


class LauncherWatch:
    def __init__(self, parent: int | None):
        self.parent = parent  # None: not started by a launcher, nothing to watch

    @classmethod
    def start(cls) -> "LauncherWatch":
        """Watch this process's launcher, if it has one (launchers set LOCAL_RANK for their workers)."""
        if "LOCAL_RANK" not in os.environ:
            return cls(None)
        watch = cls(os.getppid())
        if sys.platform.startswith("linux"):
            # Delivered when the parent dies (torchrun and accelerate start workers from their main thread).
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        watch.check()  # the launcher may have died before the prctl above took effect
        return watch

    def check(self) -> None:
        if self.parent is not None and os.getppid() != self.parent:
            raise LauncherGone(f"the launcher (pid {self.parent}) is gone: this worker (pid {os.getpid()}) stops "
                               "without writing anything more")
