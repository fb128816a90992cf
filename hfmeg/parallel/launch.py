"""Run a function on N local processes joined in one gloo world, on the CPU.

Used by the test-suite and by tools that launch their own CPU workers
(`tools/verify_parity.py`). The function and its arguments must be picklable (a
module-level function, plain data), and so must the results. A failure on any rank is
re-raised in the parent with that rank's traceback, and a hang is killed after
`timeout_s`.

How ranks start (`start_method`): forked from the caller where no GPU is present
(fast: nothing is imported again). On a machine with a GPU, once autograd has run in a
process (any backward, on CPU tensors too) its engine keeps per-device threads, and a
child forked after that refuses to run backward; there ranks are started afresh
(`spawn`: a new interpreter that imports the function's module; it inherits the
caller's stdout and stderr, as a forked rank does).
"""

from __future__ import annotations

import os
import pickle
import queue
import random
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .state import BACKEND_ENV


class WorkerError(RuntimeError):
    """A rank raised; the message carries its traceback."""


def free_port() -> int:
    """A port for a world's rendezvous, free now: a random one below the kernel's ephemeral range.

    The port is released before rank 0 binds it. An ephemeral port (what binding port 0 gives) can be
    taken in between as the source port of any outgoing connection, and a busy host (a test suite beside
    another: hundreds of gloo connections) does that often enough to send a world to another job's store;
    a random port outside that range is taken only by another caller of this function picking the same."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range below is crowded: let the kernel pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the IANA range starts at 49152
        return 49152


def _cpu_only() -> None:
    """Make this forked rank a CPU process, also on a machine with GPUs.

    CUDA cannot be re-initialised in a child forked after the parent used it, and a CPU
    world of N ranks has no business binding N GPUs. So the child's group is gloo (and
    `ParallelState.from_env` follows the group: CPU), and every "is CUDA there?" check in
    the child (RNG state capture, dtype defaults) answers no, as it would with no GPU;
    `CUDA_VISIBLE_DEVICES` carries that to any process the rank starts.
    """
    os.environ.update({BACKEND_ENV: "gloo", "CUDA_VISIBLE_DEVICES": ""})
    torch.cuda.is_available = lambda: False
    torch.cuda.device_count = lambda: 0


def _worker(fn, rank, world_size, port, args, results):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    _cpu_only()
    # One intra-op thread per rank: GNU OpenMP's thread pool does not survive fork(), so a forked
    # child that opens a parallel region after the parent used one can hang (seen in torch.zeros).
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
        # Pickled here, by value: the queue's own pickler would send a tensor's storage as a file descriptor
        # that this process serves until it exits, and a parent that reads late (a loaded host) then finds
        # the serving socket gone (FileNotFoundError).
        out = pickle.dumps(fn(*args))
        dist.barrier()
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def start_method() -> str:
    return "spawn" if torch.cuda.is_available() else "fork"


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """Run `fn(*args)` on `world_size` gloo ranks; return the per-rank results in rank order."""
    ctx = mp.get_context(start_method())
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(procs) if r not in out and p.exitcode is not None}
                if dead:  # killed or crashed before it could report (e.g. by the OOM killer)
                    raise WorkerError(f"rank(s) exited without a result: exit codes {dead}") from None
                if time.monotonic() > deadline:
                    raise WorkerError(f"timed out after {timeout_s:.0f}s waiting for "
                                      f"{world_size - len(out)} rank(s)") from None
                continue
            if status == "error":
                raise WorkerError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)  # our own rank's result (`_worker`)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()  # reaped: no zombie left, and its CPU time counts where the caller measures its children
    return [out[r] for r in range(world_size)]
