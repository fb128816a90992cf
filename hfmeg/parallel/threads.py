"""CPU threads per process: this host's cores shared out over its processes, whatever launched them, and in a
process alone on its host, re-chosen between steps for the load others put on the machine.

A plain `python recipes/...` used to compute with torch's default, every core, and OpenMP spinning in its
barriers while it waits: on a machine busy with other work each step then waits for threads that are not
running (a 5-step run took 17x as long as with one thread). torchrun sets one thread per process when it
starts several, and accelerate its own share. hfmeg sets each process's share itself: the cores this process
may run on (`os.sched_getaffinity`) over the processes on its host (`LOCAL_WORLD_SIZE`, 1 without a launcher),
at least one; and asks OpenMP to wait passively (`OMP_WAIT_POLICY=PASSIVE`, read when OpenMP starts: hfmeg
sets it on import, so it holds where hfmeg is imported before torch, as in the recipes and the `hfmeg` command).

Why a process alone on its host re-chooses (`rebalance`, called by the trainer before every step): passive
waiting removes the spinning, but not the barrier. Each parallel region of a T-thread step ends when its slowest
thread does, and beside other busy processes the kernel deschedules one of the T threads for a time slice at a
time, so the region waits for it. Measured with tools/bench_threads.py on a quiet 2-core VM beside two busy
processes in another session (docs/benchmarks.md#threads): two threads took 2.85x their quiet time, one thread
1.45x. The count is therefore the cores less the other runnable tasks on the machine, at least one: a runnable
count read between steps (`/proc/loadavg`'s running tasks, less this process's own running threads, so that its
data prefetch thread is not taken for load), the median of the last `WINDOW` reads, so that a task that ran for a
moment does not halve the next step and the count comes back within a few steps after the load has gone (a count
chosen once at start would stay cut for hours). Only where hfmeg chose the share (not under a user's
`OMP_NUM_THREADS`, nor in ranks that share a host, whose other ranks are not load, nor in any forked child, such as
`launch.spawn`'s ranks, whose OpenMP pool cannot grow after the fork).
"""

from __future__ import annotations

import os
import statistics
from collections import deque
from pathlib import Path

WINDOW = 5


def cores_per_process() -> int:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, len(os.sched_getaffinity(0)) // max(local, 1))


def own_running() -> int:
    """This process's threads in state R (running or queued to run), the calling one included."""
    own = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended between the listing and the read
            continue
        own += stat[stat.rindex(")") + 2] == "R"
    return max(own, 1)


def others_running() -> int:
    """Runnable tasks on the machine that are not this process's: `/proc/loadavg`'s running count (every runnable
    thread, this one included) less this process's own."""
    running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    return 0 if running <= 1 else max(0, running - own_running())  # 1: the reading thread alone


class CoreShare:
    """A process's thread count: `cores` when the machine is otherwise idle, fewer while others run."""

    def __init__(self, cores: int):
        self.cores = cores
        self.reads: deque[int] = deque(maxlen=WINDOW)

    def rebalance(self) -> int:
        import torch

        self.reads.append(others_running())
        n = max(1, self.cores - int(statistics.median_low(self.reads)))
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        return n


_adaptive: CoreShare | None = None
_forked = False


def _forget_in_forked_child() -> None:
    """A forked child (a `launch.spawn` rank, a test's forked run) never raises the count it was given: GNU
    OpenMP's pool does not survive fork, so more threads than the parent's pool had would wait forever for the
    missing."""
    global _adaptive, _forked
    _adaptive, _forked = None, True


os.register_at_fork(after_in_child=_forget_in_forked_child)


def share_cores() -> int:
    """Set this process's torch threads to its share of the host's cores (a forked child: at most the count it
    has); returns it. A process alone on its host with more than one core, threads not set by the user, not forked,
    re-chooses them at every `rebalance`."""
    import torch

    global _adaptive
    n = cores_per_process()
    if _forked:
        n = min(n, torch.get_num_threads())
    torch.set_num_threads(n)
    alone = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) == 1 and "OMP_NUM_THREADS" not in os.environ and not _forked
    _adaptive = CoreShare(n) if alone and n > 1 else None
    return n


def rebalance() -> int | None:
    """Before a step: the thread count for the machine's load now (`CoreShare`), where `share_cores` made this
    process's count adaptive; None elsewhere (the count stays as set)."""
    return _adaptive.rebalance() if _adaptive is not None else None
