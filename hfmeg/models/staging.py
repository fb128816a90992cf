"""A step's micro-batches on the device, with what attention needs of their document ids, before the step.

What the model reads from a micro-batch's `segment_ids` is decided here, once per micro-batch
(not once per model chunk in its forward), from what the model attends with
(`ModelChunk.uses_flex`, models/document_attention.py):

- every row one document: the micro-batch loses its `segment_ids` and the model runs plain
  causal attention. Decided on the host tensor, before the copy: reading a bool back from a
  device tensor would stall the host once per micro-batch.
- packed rows, flex attention, CP 1: the flex `BlockMask` (key `docs`), built here from the
  ids already on the device. A block mask is small (a few (s/128)² block indices per row),
  so a whole step's worth can be built ahead.
- packed rows otherwise: `segment_ids` go on, and each chunk builds the dense mask at its
  forward. That mask is b·s² elements: built ahead, a step would hold all of its
  micro-batches' masks at once, where built at use it holds those in flight. Under CP the
  keys' document ids are all-gathered over the CP group, a collective of the step itself.

Two callers. The pipeline executor stages what it is given before any compute, through
`ModelChunk.stage` (parallel/ sits below models/); staging is idempotent, so staged
micro-batches pass through. The trainer stages in the data prefetch
thread (`Stager`, `data.prefetch` steps ahead): on CUDA on a side stream, so the copies and the
mask kernels overlap the step before and the step never waits on them. The step's stream
waits on the staging event (`Stager.take`, no host sync) and every staged tensor is marked as
used by that stream (`record_stream`): when the step drops it, the caching allocator then does
not hand its memory to the side stream while the step's kernels may still read it.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import torch

from ..data.batches import StepBatch
from ..data.packing import single_document
from .document_attention import DocumentMask, plan


def to_device(mb: dict, device: torch.device) -> dict:
    """A micro-batch's tensors on `device` (other values, such as a staged mask, as they are). Host -> CUDA
    copies go through pinned memory with `non_blocking`, so the host queues them and goes on launching kernels
    instead of waiting (the caching host allocator keeps the pinned buffer alive until its copy is done)."""
    def move(v):
        if not isinstance(v, torch.Tensor) or device.type != "cuda":
            return v.to(device) if isinstance(v, torch.Tensor) else v
        return (v if v.is_cuda or v.is_pinned() else v.pin_memory()).to(device, non_blocking=True)
    return {k: move(v) for k, v in mb.items() if v is not None}


def stage_microbatch(mb: dict, device: torch.device, flex: bool, cp: int) -> dict:
    """The micro-batch on `device`, its attention decided (module doc); a staged one is returned as it is."""
    seg = mb.get("segment_ids")
    if cp == 1 and seg is not None and not seg.is_cuda and single_document(seg):
        mb = {k: v for k, v in mb.items() if k != "segment_ids"}
    mb = to_device(mb, device)
    if flex and cp == 1 and mb.get("segment_ids") is not None:
        mb["docs"] = plan(mb.pop("segment_ids"), flex=True)
    return mb


def _tensors(mbs: list[dict]) -> list[torch.Tensor]:
    out = []
    for mb in mbs:
        for v in mb.values():
            out.extend(v.tensors() if isinstance(v, DocumentMask) else [v])
    return out


@dataclass
class StagedBatch(StepBatch):
    ready: torch.cuda.Event | None = None  # recorded on the staging stream after its last copy and mask kernel


class Stager:
    """Stages a data pipeline's batches for one rank's model (module doc); `data.TrainData(stage=...)` calls it.

    `device`, `flex`, `cp`: the rank's device, whether its model attends packed rows with flex_attention
    (`ModelChunk.uses_flex`), its CP size; `ModelChunk.stager()` makes one."""

    def __init__(self, device: torch.device, flex: bool, cp: int):
        self.device, self.flex, self.cp = device, flex, cp
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, batch: StepBatch) -> StagedBatch:
        with ExitStack() as on_side:
            if self.stream is not None:  # a thread starts on device 0 with the default stream: set both
                on_side.enter_context(torch.cuda.device(self.device))
                on_side.enter_context(torch.cuda.stream(self.stream))
            mbs = [stage_microbatch(mb, self.device, self.flex, self.cp) for mb in batch.microbatches]
            ready = None
            if self.stream is not None:
                ready = torch.cuda.Event()
                ready.record(self.stream)
        return StagedBatch(mbs, batch.num_tokens, ready)

    def take(self, batch: StepBatch) -> list[dict]:
        """The batch's micro-batches, safe to use on the calling thread's current stream."""
        ready = getattr(batch, "ready", None)
        if ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready)
            for t in _tensors(batch.microbatches):
                t.record_stream(stream)
        return batch.microbatches
