"""Two rounds of an elastic job on one store that outlives them, as torchrun's shared agent store does: the second
round's ranks meet each other, not the first round's dead addresses (parallel/rendezvous.py)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hfmeg.parallel.launch import free_port
from hfmeg.parallel.state import join_world


def _rank(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), TORCHELASTIC_USE_AGENT_STORE="True", HFMEG_BACKEND="gloo")
    torch.set_num_threads(1)
    try:
        join_world(timeout_s=20)
        t = torch.full((1,), float(rank + 1))
        dist.all_reduce(t)
        results.put((rank, t.item()))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        results.put((rank, repr(e)))
    results.close()
    results.join_thread()  # the result is written before the abrupt exit below
    os._exit(0)  # no goodbye to the peer: a round's ranks die, as a killed round's do


def test_a_restarted_round_on_the_same_store_meets_afresh():
    port = free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))  # noqa: F841
    ctx = mp.get_context("fork")
    for round_ in range(3):
        results = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(2)]
        for p in procs:
            p.start()
        got = dict(results.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(timeout=30)
        assert got == {0: 3.0, 1: 3.0}, (round_, got)
