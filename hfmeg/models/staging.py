"""A step's micro-batches on the device, with what attention needs of their document ids, before the step.

What the model reads from a micro-batch's `segment_ids` is decided here, once per micro-batch
(not once per model chunk in its forward), from how the rank's model attends
(`ModelChunk.mask_planner`, models/document_attention.py):

- every row one document: the micro-batch drops its `segment_ids` and the model runs plain
  causal attention. Decided on the host tensor, before the copy: reading a bool back from a
  device tensor would stall the host once per micro-batch.
- packed rows under flex attention, under CP every row (a CP rank's queries need the
  split mask even in one document), and rows longer than a sliding window (its layers' mask): the flex `BlockMask` (`MicroBatch.docs`), built here from the
  ids already on the device (under CP the keys' ids come from the whole rows the
  micro-batch carries, `row_segment_ids`, not from a collective). A block mask is small (a
  few block indices per 128 × 128 block), so a whole step's worth can be built ahead.
- packed rows otherwise: the ids go on, and each chunk builds the dense mask at its
  forward. That mask is b·s² elements: built ahead, a step would hold all of its
  micro-batches' masks at once, where built at use it holds those in flight.

Two callers. The pipeline executor stages what it is given before any compute, through
`ModelChunk.stage` (parallel/ sits below models/); staging is idempotent, so staged
micro-batches pass through. The trainer stages in the data prefetch
thread (`Stager`, `data.prefetch` steps ahead): on CUDA on a side stream, so the copies and the
mask kernels overlap the step before and the step never waits on them. The step's stream
waits on the staging event (`Stager.take`, no host sync) and every staged tensor is marked as
used by that stream (`MicroBatch.record_stream`): when the step drops it, the caching allocator then does
not hand its memory to the side stream while the step's kernels may still read it.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, fields, replace

import torch

from ..data.batches import StepBatch
from ..data.microbatch import MicroBatch
from ..data.packing import single_document
from .document_attention import MaskPlanner


def stage_microbatch(mb: MicroBatch, planner: MaskPlanner) -> MicroBatch:
    """The micro-batch on the planner's device (`MicroBatch.to`), its attention decided (module doc); a staged
    one is returned as it is."""
    seg = mb.segment_ids
    if planner.cp == 1 and seg is not None and not seg.is_cuda and single_document(seg):
        mb = replace(mb, segment_ids=None)
    mb = mb.to(planner.device)
    if mb.docs is None and planner.builds_ahead(mb):
        mb = replace(mb, docs=planner.mask(mb.segment_ids, mb.shape[1], mb.row_segment_ids), segment_ids=None,
                     row_segment_ids=None)
    return mb


@dataclass
class StagedBatch(StepBatch):
    ready: torch.cuda.Event | None = None  # recorded on the staging stream after its last copy and mask kernel


class Stager:
    """Stages a data pipeline's batches for one rank's model (module doc); `data.TrainData(stage=...)` calls it.
    `ModelChunk.stager()` makes one."""

    def __init__(self, planner: MaskPlanner):
        self.planner = planner
        self.stream = torch.cuda.Stream(planner.device) if planner.device.type == "cuda" else None

    def __call__(self, batch: StepBatch) -> StagedBatch:
        with ExitStack() as on_side:
            if self.stream is not None:  # a thread starts on device 0 with the default stream: set both
                on_side.enter_context(torch.cuda.device(self.planner.device))
                on_side.enter_context(torch.cuda.stream(self.stream))
            mbs = [stage_microbatch(mb, self.planner) for mb in batch.microbatches]
            ready = None
            if self.stream is not None:
                ready = torch.cuda.Event()
                ready.record(self.stream)
        counts = {f.name: getattr(batch, f.name) for f in fields(StepBatch)}  # every count the batch carries
        return StagedBatch(**{**counts, "microbatches": mbs}, ready=ready)

    def take(self, batch: StepBatch) -> list[MicroBatch]:
        """The batch's micro-batches, safe to use on the calling thread's current stream."""
        ready = getattr(batch, "ready", None)
        if ready is not None:
            stream = torch.cuda.current_stream(self.planner.device)
            stream.wait_event(ready)
            for mb in batch.microbatches:
                mb.record_stream(stream)
        return batch.microbatches
