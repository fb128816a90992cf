"""The reference model of a preference run: the log-probabilities the loss measures the policy's against.

Full fine-tuning keeps a frozen copy: the configured model (`model.path`, never the resumed
checkpoint) loaded again as this rank's chunks, laid out like the policy's, with no gradient, no
optimizer state and no share of a checkpoint (a resume loads it again). LoRA and DoRA use the
policy's own chunks with their adapters switched off (`peft.adapters.adapters_off`): the frozen base,
with no second copy. `ModelPart.reference` says which a part has.

Each step, before the policy's forward and backward, `annotate` runs the reference forward-only
through the same pipeline schedule over the step's micro-batches and attaches each sequence's
log-probability (`PairBatch.ref_logps`) on the last stage, the only one that reads them.

With `preference.reference: precomputed` (`Precomputed.compute`) the reference instead reads every
batch the run will train on, and the eval batches, in one pass before the first step (a second
reader of the same data stream, from the same position), keeps their log-probabilities (2 numbers a
pair) and is dropped: training then holds no reference copy and runs no reference forward, and
attaches the stored numbers, which are bit for bit what the reference computes at each step.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
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
    def logps(self, mbs: list[PairBatch], ps, schedule: str) -> list[torch.Tensor]:
        """Each micro-batch's sequence log-probabilities under the reference (last pipeline stage; [] elsewhere)."""
        logps = _SequenceLogps(ps)
        with self.switched():
            forward_backward(self.chunks, ps, mbs, schedule=schedule, loss=logps, forward_only=True, sync_loss=False)
        return logps.out

    def annotate(self, mbs: list[PairBatch], ps, schedule: str, key: Hashable) -> list[PairBatch]:
        """`mbs` (the batch `key` names: ("train", step) or ("eval", index)) with their `ref_logps` filled on the
        last pipeline stage (as they are elsewhere)."""
        return _attach(mbs, self.logps(mbs, ps, schedule), ps)


def _attach(mbs: list[PairBatch], logps: list[torch.Tensor], ps) -> list[PairBatch]:
    if not ps.is_last_stage:
        return mbs
    return [replace(mb, ref_logps=r) for mb, r in zip(mbs, logps, strict=True)]


class Precomputed:
    """The reference's log-probabilities of known batches, computed before training (module doc)."""

    def __init__(self, stored: dict[Hashable, list[torch.Tensor]]):
        self.stored = stored

    @classmethod
    def compute(cls, reference: Reference, batches: Iterable[tuple[Hashable, list[PairBatch]]], ps,
                schedule: str) -> Precomputed:
        return cls({key: reference.logps(mbs, ps, schedule) for key, mbs in batches})

    def annotate(self, mbs: list[PairBatch], ps, schedule: str, key: Hashable) -> list[PairBatch]:
        return _attach(mbs, self.stored.pop(key) if key[0] == "train" else self.stored[key], ps)
