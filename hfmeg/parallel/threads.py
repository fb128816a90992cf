"""CPU threads per process: this host's cores shared out over its processes, whatever launched them.

A plain `python recipes/...` used to compute with torch's default, every core, and OpenMP spinning in its
barriers while it waits: on a machine busy with other work each step then waits for threads that are not
running (a 5-step run took 17x as long as with one thread). torchrun sets one thread per process when it
starts several, and accelerate its own share. hfmeg sets each process's share itself: the cores this process
may run on (`os.sched_getaffinity`) over the processes on its host (`LOCAL_WORLD_SIZE`, 1 without a launcher),
at least one; and asks OpenMP to wait passively (`OMP_WAIT_POLICY=PASSIVE`, read when OpenMP starts: hfmeg
sets it on import, so it holds where hfmeg is imported before torch, as in the recipes and the `hfmeg` command).
Measured with tools/bench_threads.py, docs/benchmarks.md#threads, against one thread, the cores less the other
runnable tasks seen at start, and twice the cores. On a VM others kept busy none did better; on a quiet VM beside
two busy processes one thread did (1.45x its quiet time against 2.85x for two, on the bench's small step), which is
not yet measured on a model-sized step; a count cut for the load at start would stay cut after the load has gone.
"""

from __future__ import annotations

import os


def cores_per_process() -> int:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, len(os.sched_getaffinity(0)) // max(local, 1))


def share_cores() -> int:
    """Set this process's torch threads to its share of the host's cores; returns it."""
    import torch

    n = cores_per_process()
    torch.set_num_threads(n)
    return n
