"""Pipeline schedules as plans: the order in which one rank runs its forwards and backwards.

A plan is a list of *steps*; a step is one or two actions `F(v, m)` / `B(v, m)`
(forward / backward of this rank's virtual chunk v on micro-batch m). The
executor (`hfmeg.parallel.pipeline`) runs a step's actions, then makes one
batched point-to-point exchange: the step's outputs go out and the next step's
inputs come in. Plans only depend on (schedule, pp, pp_rank, vpp, micro-batches),
so every rank derives its neighbours' plans too and the exchanges pair up. The
steps put the exchanges where Megatron-LM's schedules put theirs, so backends that
run point-to-point groups in posting order (NCCL) pair them up as well; this is
also why GPipe runs one chunk per rank (interleaving is the interleaved schedule's).

Notation: p stages, m micro-batches, v virtual chunks per rank; a stage is busy
for (m·v) forward and (m·v) backward slots per step.

**All-forward-all-backward (GPipe).** Every micro-batch's forward, then every
backward. Simple, but each stage keeps all m micro-batches' activations alive.
Bubble: (p−1)/m of the ideal time.

**1F1B.** Three phases on stage r:
- *warm-up*: p−r−1 forwards fill the pipeline (the last stage does none);
- *steady state*: alternate one forward and one backward, so a micro-batch's
  activations are freed as soon as possible; at most p−r micro-batches are in
  flight on stage r (p on the first stage) instead of m;
- *cool-down*: the remaining p−r−1 backwards drain the pipeline.
Same bubble as GPipe, (p−1)/m, with memory bounded by p instead of m.

**Interleaved 1F1B** (Megatron-LM, Narayanan et al. 2021). Each rank holds v
non-contiguous chunks (chunk c of the model lives on rank c mod p). Forwards run
in groups of p micro-batches per chunk: micro-batches 0..p−1 through chunk 0,
then the same through chunk 1, ..., then micro-batches p..2p−1 through chunk 0;
backwards mirror it from the last chunk. Phases on stage r:
- *warm-up*: (p−r−1)·2 + (v−1)·p forwards (all of them when m = p);
- *steady state*: steps of one forward plus one backward;
- *cool-down*: the remaining backwards.
A stage now waits for a chunk v times shorter, so the bubble shrinks to
(p−1)/(v·m), at the price of v times more point-to-point traffic. The grouping by
p needs m to be a multiple of p (Megatron's rule), checked up front.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LayoutError

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    chunk: int  # virtual chunk index on this rank
    microbatch: int


Step = list[Action]


def validate(schedule: str, pp: int, vpp: int, microbatches: int) -> None:
    """Reject layouts a schedule cannot run, before any work starts."""
    if schedule not in SCHEDULES:
        raise LayoutError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")
    if microbatches < 1:
        raise LayoutError("a step needs at least one micro-batch")
    if vpp > 1 and pp == 1:
        raise LayoutError(f"vpp={vpp} needs pipeline parallelism (pp > 1)")
    if schedule == "interleaved":
        if vpp < 2:
            raise LayoutError(f"the interleaved schedule needs vpp >= 2 virtual chunks per rank, got vpp={vpp}")
        if microbatches % pp:
            raise LayoutError(
                f"the interleaved schedule needs micro-batches ({microbatches}) to be a multiple of pp ({pp})"
            )
    elif vpp > 1:
        raise LayoutError(f"{schedule} runs one chunk per rank; with vpp={vpp} use schedule 'interleaved'")


def plan(schedule: str, pp: int, pp_rank: int, vpp: int, microbatches: int, forward_only: bool = False) -> list[Step]:
    """This rank's steps for one global-batch step (validated first)."""
    validate(schedule, pp, vpp, microbatches)
    if forward_only:
        return [[a] for a in _forward_order(schedule, pp, vpp, microbatches)]
    if schedule == "gpipe":
        return _gpipe(microbatches)
    if schedule == "1f1b":
        return _one_f_one_b(pp, pp_rank, microbatches)
    return _interleaved(pp, pp_rank, vpp, microbatches)


def _forward_order(schedule: str, pp: int, vpp: int, m: int) -> list[Action]:
    if schedule == "interleaved":
        return [_interleaved_action("F", k, pp, vpp) for k in range(m * vpp)]
    return [Action("F", 0, i) for i in range(m)]


def _gpipe(m: int) -> list[Step]:
    return [[Action("F", 0, i)] for i in range(m)] + [[Action("B", 0, i)] for i in range(m)]


def _one_f_one_b(pp: int, rank: int, m: int) -> list[Step]:
    warmup = min(pp - rank - 1, m)
    steps = [[Action("F", 0, i)] for i in range(warmup)]
    for i in range(m - warmup):
        steps += [[Action("F", 0, warmup + i)], [Action("B", 0, i)]]
    steps += [[Action("B", 0, i)] for i in range(m - warmup, m)]
    return steps


def _interleaved_action(kind: str, k: int, pp: int, vpp: int) -> Action:
    """The k-th forward (or backward) of a rank: groups of pp micro-batches per chunk."""
    group, within = divmod(k, pp * vpp)
    chunk = within // pp
    if kind == "B":
        chunk = vpp - 1 - chunk
    return Action(kind, chunk, group * pp + k % pp)


def _interleaved(pp: int, rank: int, vpp: int, m: int) -> list[Step]:
    total = m * vpp
    warmup = total if m == pp else min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
    steps = [[_interleaved_action("F", k, pp, vpp)] for k in range(warmup)]
    for i in range(total - warmup):
        steps.append([_interleaved_action("F", warmup + i, pp, vpp), _interleaved_action("B", i, pp, vpp)])
    steps += [[_interleaved_action("B", k, pp, vpp)] for k in range(total - warmup, total)]
    return steps
