"""Point-to-point transfers between neighbouring pipeline stages.

Activations travel forward (model chunk c -> c + 1) and their gradients travel
back (c + 1 -> c). Every such tensor has the shape the config implies,
`[s/tp if SP else s, micro_batch, hidden]` in the chunk dtype, so receivers
allocate their buffers up front and no shape metadata is ever exchanged.
A transfer may carry a second, small tensor beside its payload (`Transfer.side`: an MoE
model's router sums and their gradient, `models/load_balancing.py`), its shape also known
from the config; it goes as its own message right after the payload. A pipeline's
transfers all carry one or none, so dense models send exactly what they always did.

All transfers of one schedule step go out as one `dist.batch_isend_irecv` call
(NCCL runs them as one group, so a send and a receive between the same pair of
ranks cannot block each other). Receives are waited before the step ends; sends
are waited later by the caller (see `P2P.exchange`).

Messages are matched by a tag derived from (direction, sending model chunk,
micro-batch) where the backend supports tags (gloo). With PP=2 and interleaving,
both activations and gradients flow between the same two ranks in both
directions; the tag makes every receive pick exactly the message it expects,
whatever order the two ranks post their operations in. NCCL ignores tags and
matches in posting order, which the schedules keep consistent on both sides
(every batch lists activation traffic before gradient traffic).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

ACTIVATION, GRADIENT = 0, 1


@dataclass
class Transfer:
    """One send or receive: `tensor` is the payload, or the buffer to fill."""

    tensor: torch.Tensor
    peer: int  # global rank
    direction: int  # ACTIVATION or GRADIENT
    sender_chunk: int  # model-order index of the chunk that produced the tensor
    microbatch: int
    is_send: bool
    side: torch.Tensor | None = None  # sent or received right after `tensor`

    def parts(self) -> list[torch.Tensor]:
        return [self.tensor] if self.side is None else [self.tensor, self.side]


def message_tag(direction: int, sender_chunk: int, microbatch: int, num_chunks: int, part: int = 0,
                parts: int = 1) -> int:
    """The tag of part `part` of `parts` of a transfer; with one part, that of a transfer without a side."""
    return ((microbatch * num_chunks + sender_chunk) * 2 + direction) * parts + part


class P2P:
    """Batched sends/receives for one rank of a pipeline."""

    def __init__(self, num_chunks: int):
        self.num_chunks = num_chunks
        # gloo matches on tags; NCCL ignores them and matches in posting order.
        self.use_tags = dist.is_initialized() and dist.get_backend() == "gloo"

    def exchange(self, transfers: list[Transfer]) -> list[tuple[Transfer, dist.Work]]:
        """Post all `transfers` at once; wait for the receives, return the sends still in flight.

        Only receives are waited: a send may complete only when its receiver gets
        to the matching step, and waiting for it here could deadlock schedules in
        which a rank runs several forwards before its neighbour asks for their
        outputs. The caller keeps the returned sends' tensors alive until `Work.wait()`.
        """
        if not transfers:
            return []
        # Activation traffic first, then gradients: the same order on every rank (see module doc).
        ordered = sorted(transfers, key=lambda t: t.direction)
        ops, owners = [], []  # one message per part, each transfer's parts one after another
        for t in ordered:
            fn = dist.isend if t.is_send else dist.irecv
            parts = t.parts()
            for i, tensor in enumerate(parts):
                tag = (message_tag(t.direction, t.sender_chunk, t.microbatch, self.num_chunks, i, len(parts))
                       if self.use_tags else 0)
                ops.append(dist.P2POp(fn, tensor, t.peer, tag=tag))
                owners.append(t)
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):
            # A coalescing backend (NCCL) returns one handle for the whole group; its wait
            # only orders the compute stream after the group and does not block the host.
            for work in works:
                work.wait()
            return [(t, works[-1]) for t in ordered if t.is_send]
        pending = []
        for t, work in zip(owners, works):
            if t.is_send:
                pending.append((t, work))
            else:
                work.wait()
        return pending
