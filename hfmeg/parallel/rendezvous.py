"""A store of its own for each round of an elastic job, so that a restarted round never reads the last one's keys.

Under torchrun's c10d rendezvous the agents share one TCPStore with their workers for the whole job
(`TORCHELASTIC_USE_AGENT_STORE=True`, torch's default) and the workers' keys carry no round: torch assumes
a new store per restart, which only holds where the store is not shared. After a restart, rank 0 reads
the addresses that the dead round's ranks published under the same keys and gloo's `connectFullMesh`
fails with "Connection refused" until the restarts run out. The workers cannot name the round themselves:
`TORCHELASTIC_RESTART_COUNT` counts each agent's own restarts, and an agent that restarts its workers for
another host's failure (a membership change) does not count it, so two hosts may disagree.

So rank 0 draws a random token per round and every other rank asks for it: rank r appends a fresh
nonce of its own to a queue in the store and waits for the answer under a key named by that nonce,
which no earlier round can have written. Rank 0 answers every question in the queue (a dead round's
too, harmlessly) until a first barrier of the new group has passed, which needs every rank of the round; the round's keys
then live under `hfmeg/round/<token>/`. Outside torchrun's shared store (a store started by rank 0 itself,
as accelerate's static rendezvous and `launch.spawn` do) every round has a new store and nothing is done.
"""

from __future__ import annotations

import os
import secrets
import threading
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

ROOT = "hfmeg/round"
POLL_S = 0.02


def shared_across_rounds() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def rejoin_warning() -> str | None:
    """The line to print when a host started again could not rejoin this job: several hosts, restarts allowed,
    on torchrun's shared store, where a node new to a later round waits for the store's address, which only
    the first round publishes (docs/multihost.md, Restarts). None where that cannot happen."""
    hosts = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if hosts > 1 and restarts > 0 and shared_across_rounds():
        return (f"hfmeg: {hosts} hosts with --max-restarts {restarts} on torchrun's shared store: a host whose "
                "torchrun is started again cannot rejoin; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every "
                "host's torchrun environment (docs/multihost.md)")
    return None


@contextmanager
def round_store(timeout_s: float):
    """`init_process_group`'s store arguments for this round: {} outside torchrun's shared store, else a
    `PrefixStore` under this round's token with the rank and world size. Rank 0 answers the other ranks'
    questions until the block ends (call `init_process_group` inside it), which ends with a barrier."""
    if not shared_across_rounds():
        yield {}
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = _client(timeout_s)
    done = threading.Event()
    answering = None
    if rank == 0:
        token = secrets.token_hex(8)
        # Its own connection: a client serves one request at a time, and the group's start blocks in a `get`.
        answering = threading.Thread(target=_answer, args=(_client(timeout_s), token, done), daemon=True,
                                     name="hfmeg-round")
        answering.start()
    else:
        token = _ask(store)
    try:
        yield dict(store=dist.PrefixStore(f"{ROOT}/{token}/", store), rank=rank, world_size=world)
        dist.barrier()  # every rank has the token once all are in the group (NCCL's may return before they are)
    finally:
        done.set()
        if answering is not None:  # ended here, not at the interpreter's exit in the middle of a store call
            answering.join()


def _client(timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s))


def _ask(store: dist.Store) -> str:
    nonce = secrets.token_hex(8)
    slot = store.add(f"{ROOT}/asked", 1)
    store.set(f"{ROOT}/ask/{slot}", nonce)
    return store.get(f"{ROOT}/answer/{nonce}").decode()  # waits up to the store's timeout for rank 0


def _answer(store: dist.Store, token: str, done: threading.Event) -> None:
    """Rank 0: give `token` to every nonce in the queue until `done`. A slot counted but not yet written
    waits for a later look (its asker may also have died in between: it then waits forever, harmlessly)."""
    seen, pending = 0, []
    while not done.is_set():
        asked = store.add(f"{ROOT}/asked", 0)
        pending += range(seen + 1, asked + 1)
        seen = asked
        for slot in list(pending):
            key = f"{ROOT}/ask/{slot}"
            if store.check([key]):
                store.set(f"{ROOT}/answer/{store.get(key).decode()}", token)
                pending.remove(slot)
        done.wait(POLL_S)
