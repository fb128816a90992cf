"""Run one global-batch step of a pipeline schedule: `forward_backward`.

The plan (`hfmeg.parallel.schedules`) says which forward/backward runs when; this
file executes it. After each step, one batched exchange (`p2p.P2P`) sends the
step's outputs and receives the next step's inputs, so every wait is on data
the next action needs and sends and receives between two ranks travel together.

Memory: an intermediate chunk keeps, per micro-batch in flight, only what
autograd saved plus its received input (whose `.grad` is sent back). The output
activation's storage is released as soon as it has been sent; its backward then
goes through the autograd engine directly, since `torch.autograd.backward` would
compare the gradient's shape with the (now empty) output. This is what keeps
1F1B at about pp micro-batches of activations per stage.

Loss: the last chunk returns per-token losses (-log p of each label token, 0 where the
label is ignored) and a `MicroBatchLoss` reduces them to the micro-batch's scalar. The
default, `TokenMean`: sum of its per-token losses / `num_tokens`, the count of
non-ignored label tokens of the whole global batch (all micro-batches and all DP
ranks). Backward of these gives global-batch-mean gradients, so DP reductions sum.
Another objective hands its own reduction (DPO: train/preference.py, per-sequence
log-probabilities grouped into pairs), under the same contract: the micro-batch losses
of a global batch, summed over micro-batches and DP x CP ranks, are its loss.
Under context parallelism the micro-batches hold this CP rank's tokens of every
row (`context.py`; the data pipeline cuts them) and its loss is the sum over those: the same sum split
over the CP ranks, which the DP x CP gradient reduction and the logged loss add up.
An MoE model whose config asks for the router's load-balancing loss adds it per
micro-batch (computed over that micro-batch, as transformers computes it for one
forward), divided by the number of micro-batches of the global batch (all DP ranks):
the mean over micro-batches, so with one micro-batch the loss is transformers' loss.
That loss spans every MoE layer of the model, so with PP > 1 the chunks' running router
sums (`models/load_balancing.py`: a few numbers per micro-batch) travel beside each
activation as a second activation: a chunk receives them as a leaf that requires grad,
adds its own and sends the total on; the last chunk computes the loss from the
model-wide sums, and the sums' gradient travels back beside the activation gradient
and enters each earlier chunk's backward as a second root. Dense models and PP = 1 send
nothing more.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Protocol

import torch

from ..data.microbatch import MicroBatch, step_shape
from ..errors import LayoutError
from .p2p import ACTIVATION, GRADIENT, P2P, Transfer
from .schedules import Action, Step, plan
from .state import ParallelState
from .timeline import Timeline


class GradSync(Protocol):
    def set_last_microbatch(self, chunk: int, is_last: bool) -> None: ...


class MicroBatchLoss(Protocol):
    def __call__(self, per_token: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """The micro-batch's share of the global batch's loss (a 0-dim tensor) from its per-token losses `[b, s]`."""
        ...


class TokenMean:
    """The next-token loss: the micro-batch's per-token losses summed, over the global batch's label tokens."""

    def __init__(self, num_tokens: int):
        if num_tokens < 1:
            raise LayoutError(f"num_tokens must count at least one label token, got {num_tokens}")
        self.num_tokens = num_tokens

    def __call__(self, per_token: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        return per_token.sum() / self.num_tokens


def _backward_through(outputs: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...]) -> None:
    # The engine call behind torch.autograd.backward, minus its Python-side shape
    # check against the activation output, whose storage we have already released.
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=outputs, grad_tensors=grads, keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True,
    )


class _Executor:
    def __init__(self, chunks, ps: ParallelState, microbatches: list[MicroBatch], loss: MicroBatchLoss, grad_sync,
                 timeline, forward_only, loss_scale=1.0):
        self.chunks, self.ps = chunks, ps
        # Every copy queued and every mask that can be built ahead built before any compute, once per
        # micro-batch (models/staging.py); micro-batches the trainer staged in its prefetch thread pass through.
        self.mbs = [chunks[0].stage(mb) for mb in microbatches]
        self.loss_of, self.grad_sync, self.timeline = loss, grad_sync, timeline
        self.forward_only, self.loss_scale = forward_only, loss_scale
        self.n_chunks = ps.pp * len(chunks)
        self.p2p = P2P(self.n_chunks)
        b, s = self.mbs[0].shape
        self.seq_len = s
        local_s = s // ps.tp if ps.sequence_parallel else s
        self.shape = (local_s, b, chunks[0].stage_width)
        self.dtype = next(chunks[0].parameters()).dtype
        # Router sums travel beside the activations (module doc): MoE models with the aux loss, PP > 1.
        self.sided = self.n_chunks > 1 and chunks[0].cfg.adds_aux_loss
        self.inbox: dict[tuple[str, int, int], tuple] = {}  # -> (activation or its gradient, side or None)
        # (chunk, mb) -> (input, output or loss, received router sums, sent router sums)
        self.saved: dict[tuple[int, int], tuple] = {}
        self.loss = torch.zeros((), dtype=torch.float32, device=ps.device)
        self.in_flight: list = []  # sends posted but not yet known complete

    def model_chunk(self, v: int) -> int:
        return v * self.ps.pp + self.ps.pp_rank

    # -- communication ----------------------------------------------------------
    def receives(self, step: Step) -> list[Transfer]:
        out = []
        for a in step:
            c = self.model_chunk(a.chunk)
            if a.kind == "F" and c > 0:
                peer, direction, sender = self.ps.prev_rank, ACTIVATION, c - 1
            elif a.kind == "B" and c < self.n_chunks - 1:
                peer, direction, sender = self.ps.next_rank, GRADIENT, c + 1
            else:
                continue
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.ps.device)
            side = self.chunks[a.chunk].empty_router_sums() if self.sided else None
            out.append(Transfer(buf, peer, direction, sender, a.microbatch, False, side))
            self.inbox[(a.kind, a.chunk, a.microbatch)] = (buf, side)
        return out

    # -- actions ----------------------------------------------------------------
    def forward(self, a: Action) -> list[Transfer]:
        chunk, mb = self.chunks[a.chunk], self.mbs[a.microbatch]
        c = self.model_chunk(a.chunk)
        sums = None
        if chunk.pre_process:
            x = mb.input_ids
        else:
            x, sums = self.inbox.pop(("F", a.chunk, a.microbatch))
            x.requires_grad_(not self.forward_only)
            if sums is not None:
                sums.requires_grad_(not self.forward_only)
        labels = mb.labels if chunk.post_process else None
        sent = None
        with torch.set_grad_enabled(not self.forward_only):
            out = chunk(x, labels=labels, seq_len=self.seq_len, position_ids=mb.position_ids,
                        segment_ids=mb.segment_ids, row_segment_ids=mb.row_segment_ids, docs=mb.docs,
                        received_sums=sums)
            if chunk.post_process:
                out = self.loss_of(out, mb)
                aux = chunk.take_aux_loss()
                if aux is not None:
                    out = out + aux / (len(self.mbs) * self.ps.dp)
                self.loss += out.detach().float()
            elif self.sided:
                sent = chunk.router_sums(sums)
        if not self.forward_only:
            self.saved[(a.chunk, a.microbatch)] = (x, out, sums, sent)
        if chunk.post_process:
            return []
        side = sent.detach() if sent is not None else None
        return [Transfer(out.detach(), self.ps.next_rank, ACTIVATION, c, a.microbatch, True, side)]

    def backward(self, a: Action, is_last: bool) -> list[Transfer]:
        if self.grad_sync is not None:
            self.grad_sync.set_last_microbatch(a.chunk, is_last)
        chunk = self.chunks[a.chunk]
        x, out, sums, sent = self.saved.pop((a.chunk, a.microbatch))
        if chunk.post_process:
            torch.autograd.backward(out * self.loss_scale if self.loss_scale != 1.0 else out)
        else:
            grad, side_grad = self.inbox.pop(("B", a.chunk, a.microbatch))
            # The router sums' gradient is a second root, where this chunk's sums carry one
            # (not on a first chunk without MoE layers, whose sums are zeros).
            if sent is not None and sent.requires_grad:
                _backward_through((out, sent), (grad, side_grad))
            else:
                _backward_through((out,), (grad,))
        if chunk.pre_process:
            return []
        side = sums.grad if sums is not None else None
        return [Transfer(x.grad, self.ps.prev_rank, GRADIENT, self.model_chunk(a.chunk), a.microbatch, True, side)]

    # -- the loop -----------------------------------------------------------------
    def run(self, steps: list[Step]) -> None:
        last_backward = {}
        for i, step in enumerate(steps):
            for a in step:
                if a.kind == "B":
                    last_backward[a.chunk] = (i, a.microbatch)
        self.p2p.exchange(self.receives(steps[0]))
        for i, step in enumerate(steps):
            sends = []
            for a in step:
                with self.timeline.span(a) if self.timeline is not None else nullcontext():
                    if a.kind == "F":
                        sends += self.forward(a)
                    else:
                        sends += self.backward(a, last_backward[a.chunk] == (i, a.microbatch))
            upcoming = self.receives(steps[i + 1]) if i + 1 < len(steps) else []
            self.in_flight += self.p2p.exchange(sends + upcoming)
            self.release_sent(wait=False)
        self.release_sent(wait=True)

    def release_sent(self, wait: bool) -> None:
        """Drop completed sends; free the storage of activations that have left this rank."""
        still = []
        for t, work in self.in_flight:
            if not wait and not work.is_completed():
                still.append((t, work))
                continue
            work.wait()
            key = (_chunk_of(t, self.ps), t.microbatch)
            if t.direction == ACTIVATION and key in self.saved:
                # Only the autograd node behind the output is still needed, not its data.
                out = self.saved[key][1]
                out.data = torch.empty((1,), dtype=out.dtype, device=out.device)
        self.in_flight = still


def _chunk_of(t: Transfer, ps: ParallelState) -> int:
    return t.sender_chunk // ps.pp


def forward_backward(
    chunks: list,
    ps: ParallelState,
    microbatches: list[MicroBatch],
    *,
    schedule: str,
    num_tokens: int | None = None,
    loss: MicroBatchLoss | None = None,
    grad_sync: GradSync | None = None,
    timeline: Timeline | None = None,
    forward_only: bool = False,
    loss_scale: float = 1.0,
    sync_loss: bool = True,
) -> float | torch.Tensor | None:
    """Forward and backward of this rank's share of one global batch.

    `chunks` are this rank's model chunks in virtual order (model chunk
    `v * pp + pp_rank` is `chunks[v]`); `microbatches` are this DP rank's
    micro-batches (`MicroBatch`: `input_ids` and `labels` `[b, s]`, optional
    `position_ids`, `segment_ids`; under CP this rank's `s / cp` tokens of each row, as
    `MicroBatch.shard` cuts them), the same list on every stage of a pipeline:
    every stage reads the shape of `input_ids` and the positions / document ids
    (RoPE and the packed-document mask are applied in every layer).
    Gradients accumulate into `.grad`; `grad_sync` (the data-parallel wrapper, or the
    optimizer that holds one) reduces them: before each backward of chunk v it is
    told whether that is the chunk's last micro-batch of the step.
    `loss_scale` multiplies the loss before backward (fp16 dynamic loss scaling;
    the optimizer divides it out of the gradients).

    `loss` reduces a micro-batch's per-token losses on the last stage; given
    `num_tokens` instead, the next-token loss `TokenMean(num_tokens)`.
    Returns, on last-stage ranks, the sum over this rank's micro-batches of
    their losses (`TokenMean`: sum(per-token loss) / num_tokens), so summing it
    over DP ranks gives the global-batch mean loss; None on other stages. With `sync_loss=False` that
    sum stays a 0-dim float32 tensor on the device: no host sync here, so a
    caller can read it together with its other per-step values in one.
    """
    if len(chunks) != ps.vpp:
        raise LayoutError(f"this rank holds {len(chunks)} model chunks but the layout has vpp={ps.vpp}")
    if (loss is None) == (num_tokens is None):
        raise LayoutError("forward_backward takes either num_tokens (the next-token loss) or a loss")
    loss = loss or TokenMean(num_tokens)
    steps = plan(schedule, ps.pp, ps.pp_rank, ps.vpp, len(microbatches), forward_only)
    s = step_shape(microbatches)[1]
    ps.grid.check_sequence(s * ps.cp)  # s: this CP rank's part of the rows
    ex = _Executor(chunks, ps, microbatches, loss, grad_sync, timeline, forward_only, loss_scale)
    ex.run(steps)
    if not ps.is_last_stage:
        return None
    return ex.loss.item() if sync_loss else ex.loss
