"""Named tensors of every rank, gathered on global rank 0 with no file in between.

A weight push to an in-process generation engine (train/rollout.py) needs, on the one rank that generates, every
model-parallel rank's shard: the tensors each rank would write into its checkpoint folder, under the names it would
write them. `gather_named` hands them over as the folder would, in memory: rank 0 gets, per rank that gave
anything, its `meta` (a small picklable description: its TP and PP ranks, a table of split kinds) and its tensors
by name; what the ranks' files would have been rebuilt into full tensors stays the readers' (checkpoint/rules.py).

Collective over the default group. The names, dtypes and shapes go first (one `gather_object` of small lists),
then each tensor alone, point to point (`send`/`recv`, one rank's tensors after another's, each in its order), so
no rank copies its shard into one buffer; rank 0 holds everything it received (the whole model, once, as the
shared-memory folder a file push wrote held it) and moves each received tensor to the CPU, where the engine and
the exporter read it, so a GPU holds one of them at a time. Rank 0's own tensors are not copied.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def gather_named(tensors: list[tuple[str, torch.Tensor]], meta: Any, device: torch.device
                 ) -> list[tuple[Any, dict[str, torch.Tensor]]] | None:
    """On rank 0: [(meta, {name: tensor})] of every rank that gave tensors or a meta, in rank order; None elsewhere.
    A rank with nothing to give passes `[]` and None. `device`: where this rank's collectives run."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return _own(tensors, meta)
    rank = dist.get_rank()
    heads = [(meta, [(n, t.dtype, tuple(t.shape)) for n, t in tensors])]
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(heads[0], gathered, dst=0)
    if rank != 0:
        for _, t in tensors:
            dist.send(t.detach().contiguous(), dst=0)
        return None
    out = _own(tensors, meta)
    for src in range(1, len(gathered)):
        their_meta, specs = gathered[src]
        if not specs and their_meta is None:
            continue
        received = {}
        for name, dtype, shape in specs:
            buf = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buf, src=src)
            received[name] = buf.cpu()
        out.append((their_meta, received))
    return out


def _own(tensors: list[tuple[str, torch.Tensor]], meta: Any) -> list[tuple[Any, dict[str, torch.Tensor]]]:
    """Rank 0's own entry of the gathered list: its tensors on the CPU, or nothing where it gave nothing."""
    return [(meta, {n: t.detach().cpu() for n, t in tensors})] if tensors or meta is not None else []
