"""The reference model of a preference run: the log-probabilities the loss measures the policy's against.

Full fine-tuning keeps a frozen copy: the configured model (`model.path`, never the resumed
checkpoint) loaded again as this rank's chunks, laid out like the policy's, with no gradient, no
optimizer state and no share of a checkpoint (a resume loads it again). LoRA and DoRA use the
policy's own chunks with their adapters switched off (`peft.adapters.adapters_off`): the frozen base,
with no second copy. `ModelPart.reference` says which a part has.

Each step, before the policy's forward and backward, `annotate` runs the reference forward-only
through the same pipeline schedule over the step's micro-batches and attaches each sequence's
log-probability (`PairBatch.ref_logps`) on the last stage, the only one that reads them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Callable

import torch

from ...data.microbatch import PairBatch
from ...parallel.pipeline import forward_backward
from ..preference import sequence_logps


class _SequenceLogps:
    """A forward-only `MicroBatchLoss` that keeps each micro-batch's sequence log-probabilities, in order."""

    def __init__(self, ps):
        self.ps, self.out = ps, []

    def __call__(self, per_token: torch.Tensor, mb: PairBatch) -> torch.Tensor:
        self.out.append(sequence_logps(per_token, mb, self.ps)[0])
        return per_token.new_zeros(())


class Reference:
    def __init__(self, chunks, switched: Callable[[], AbstractContextManager] = nullcontext):
        self.chunks, self.switched = chunks, switched

    @torch.no_grad()
    def annotate(self, mbs: list[PairBatch], ps, schedule: str) -> list[PairBatch]:
        """`mbs` with their `ref_logps` filled on the last pipeline stage (as they are elsewhere)."""
        logps = _SequenceLogps(ps)
        with self.switched():
            forward_backward(self.chunks, ps, mbs, schedule=schedule, loss=logps, forward_only=True, sync_loss=False)
        if not ps.is_last_stage:
            return mbs
        return [replace(mb, ref_logps=r) for mb, r in zip(mbs, logps.out, strict=True)]
