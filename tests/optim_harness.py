"""Shared pieces of the optimizer tests: data, a single-process AdamW reference, layouts.

The reference is a TP=1 hfmeg chunk of the whole model trained with plain
`torch.optim.AdamW` (decay / no-decay groups from `no_weight_decay`) and
`torch.nn.utils.clip_grad_norm_`, one backward over the whole global batch per step.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from bounds import FP32_EPS, ROUNDING_FACTOR, within  # noqa: F401 - the tests import both from here too

from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.checkpoint.rules import chunk_rules, to_hf, to_local
from hfmeg.optim import DistributedOptimizer, OptimizerConfig, no_weight_decay
from hfmeg.data.microbatch import MicroBatch
from hfmeg.parallel.roles import named_roles
from hfmeg.parallel.state import ParallelState
from hfmeg.parallel.stored_names import stored_tensors

ROWS, SEQ, VOCAB = 4, 16, 300  # rows per micro-batch of the global batch

# The optimizer settings of every parity test: clipping and weight decay on, buckets small
# enough that parameters straddle shard boundaries. eps = 1e-5 and lr = 1e-3 keep the
# comparison well conditioned. Adam's update is ~lr * g / (|g| + eps) whatever the size of
# g, so fp32 reduction-order noise in a gradient (present even at DP=1 between a TP layout
# and the TP=1 reference, in all three modes alike: it comes from the model's TP sums, not
# from the optimizer) moves a parameter by up to O(lr) per step. At lr = 3e-3 that noise
# alone put TP=2 (SP) and TP=4 at 1.1-1.5e-6 relative after 10 steps; at 1e-3 the worst
# layout is 6.4e-7, while a stale, missing or doubly applied update still shows as
# ~lr / |param| >> 1e-6.
CFG = dict(lr=1e-3, weight_decay=0.1, grad_clip=0.5, bucket_size=5000, eps=1e-5)


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((ROWS, 1), -100)], dim=1)
    labels[0, :3] = -100  # some masked tokens, so the token count matters
    return ids, labels


def global_tokens(step: int, ga: int) -> int:
    return sum(int((batch(step, m)[1] != -100).sum()) for m in range(ga))


def reference(folder, cfg: OptimizerConfig, ga: int, steps: int, ps1: ParallelState, dtype=torch.float32):
    """Single-process AdamW in `dtype`: returns (per-step losses, final {name: param})."""
    model = load_chunks(HFCheckpoint(folder), ps1, dtype=dtype)[0]
    roles = named_roles(model)
    groups = [{"params": [p for _, p, r in roles if not no_weight_decay(r, cfg)]},
              {"params": [p for _, p, r in roles if no_weight_decay(r, cfg)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                            weight_decay=cfg.weight_decay)
    losses = []
    for step in range(steps):
        ntok = global_tokens(step, ga)
        total = 0.0
        for m in range(ga):
            ids, labels = batch(step, m)
            loss = model(ids, labels=labels).sum() / ntok
            loss.backward()
            total += loss.item()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: t.detach().clone() for n, t in stored_tensors(model).items()}


# The parity bound of an optimizer run (bounds.py: ROUNDING_FACTOR): the same AdamW run in float64 is the truth,
# and the unsharded fp32 reference's own distance from it (per parameter tensor, per step's loss) is what fp32
# rounding does to this computation on this CPU; a sharded run sums the same terms in another order. An error of
# the optimizer itself (a stale, missing or doubly applied update) moves a parameter by ~lr / |param|, orders above.


@dataclasses.dataclass
class Rounding:
    """How far fp32 rounding puts the unsharded fp32 run from the float64 run (plain numbers, so a rank
    can return them to the test)."""

    loss: float  # worst per-step relative loss distance
    rel: float  # worst per-tensor ||fp32 - fp64|| / ||fp64||
    rel_max: float  # worst per-tensor max|fp32 - fp64| / max|fp64|


@dataclasses.dataclass
class Truth:
    """The float64 run, and its `Rounding`."""

    losses: list[float]
    params: dict[str, torch.Tensor]
    rounding: Rounding


def loss_distance(ours: list[float], ref: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(ours, ref))


def truth(folder, cfg: OptimizerConfig, ga: int, steps: int, ps1: ParallelState) -> Truth:
    losses32, params32 = reference(folder, cfg, ga, steps, ps1)
    return truth_of(reference(folder, cfg, ga, steps, ps1, dtype=torch.float64), (losses32, params32))


def truth_of(run64, run32) -> Truth:
    """The `Truth` of any run given as (losses, {name: tensor}) in float64 and in fp32 (a reference other than
    `reference`, e.g. one that unshares layers mid-run, or a single forward + backward's loss and gradients)."""
    (losses64, params64), (losses32, params32) = run64, run32
    diffs = {n: params32[n].double() - params64[n] for n in params64}
    return Truth(losses64, params64, Rounding(loss_distance(losses32, losses64),
                                              max((diffs[n].norm() / params64[n].norm()).item() for n in diffs),
                                              max((diffs[n].abs().max() / params64[n].abs().max()).item()
                                                  for n in diffs)))


def check_within_rounding(rel: float | None, rel_max: float | None, loss_rel: float | None, r: Rounding,
                          partial_losses: int, row, *, runs: int = 1) -> None:
    """A sharded run's distances from the float64 run (as `max_rel_diff` and `loss_distance` measure them)
    are rounding: within ROUNDING_FACTOR times the fp32 reference's own, `r`. None: not measured.

    A step's loss is a float64 sum of `partial_losses` fp32 partial losses (DP x GA), each rounded once
    more than the reference's (whose loss rounds to the same fp32 value as float64's at GA 1): 2 eps per term.
    `runs=2`: the distances are between two sharded runs, each within the bound of the float64 run."""
    if rel is not None:
        within(rel, runs * (ROUNDING_FACTOR * r.rel + 4 * FP32_EPS), "params rel (fp64 rounding)", row)
    # The worst element against the tensor's largest: a wrong update of a few elements (a shard's edge)
    # shows here when the norm averages it away.
    if rel_max is not None:
        within(rel_max, runs * (ROUNDING_FACTOR * r.rel_max + 4 * FP32_EPS), "params rel_max (fp64 rounding)", row)
    if loss_rel is not None:
        within(loss_rel, runs * (ROUNDING_FACTOR * r.loss + 2 * partial_losses * FP32_EPS), "loss (fp64 rounding)",
               row)


def build_rank_chunk(folder, ps: ParallelState, dtype=torch.float32, **options):
    """This rank's chunk (`options`: ModelChunk's, e.g. compile_backend)."""
    return load_chunks(HFCheckpoint(folder), ps, dtype=dtype, **options)[0]


def micro_step(chunk, opt, ps: ParallelState, step: int, micro: int, ntok: int, is_last: bool) -> float:
    """Forward + backward of this rank's slice of one micro-batch; PP=2 by plain send/recv."""
    ids, labels = batch(step, micro)
    rows = ROWS // ps.dp
    ids, labels = ids[ps.dp_rank * rows:(ps.dp_rank + 1) * rows], labels[ps.dp_rank * rows:(ps.dp_rank + 1) * rows]
    opt.set_last_microbatch(0, is_last)
    if ps.pp == 1:  # under context parallelism, this CP rank's tokens of each row
        mb = MicroBatch(input_ids=ids, labels=labels).shard(ps.cp_rank, ps.cp)
        loss = chunk(mb.input_ids, position_ids=mb.position_ids, labels=mb.labels).sum() / ntok
        opt.scale_loss(loss).backward()
        return loss.item()
    s_local = SEQ // ps.tp if ps.sequence_parallel else SEQ
    if ps.is_first_stage:
        out = chunk(ids)
        dist.send(out.detach().contiguous(), ps.next_rank)
        grad = torch.empty_like(out)
        dist.recv(grad, ps.prev_rank)
        out.backward(grad)
        return 0.0
    x = torch.empty(s_local, rows, chunk.cfg.hidden_size)
    dist.recv(x, ps.prev_rank)
    x.requires_grad_(True)
    loss = chunk(x, labels=labels).sum() / ntok
    opt.scale_loss(loss).backward()
    dist.send(x.grad.contiguous(), ps.next_rank)
    return loss.item()


def train(chunk, opt, ps, ga: int, steps: int, first_step: int = 0) -> list[float]:
    """Returns the global loss of each step (summed over DP; PP: from the last stage)."""
    losses = []
    for step in range(first_step, first_step + steps):
        ntok = global_tokens(step, ga)
        local = sum(micro_step(chunk, opt, ps, step, m, ntok, m == ga - 1) for m in range(ga))
        opt.step()
        t = torch.tensor([local if ps.tp_rank == 0 and ps.is_last_stage else 0.0], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(t.item())
    return losses


def max_rel_diff(chunk, ps: ParallelState, ref: dict[str, torch.Tensor]) -> tuple[float, float, int]:
    """Worst per-tensor ||ours - ref|| / ||ref|| and max|ours - ref| / max|ref| over this rank's
    parameters (against TP slices of ref), and how many tensors were compared."""
    params = stored_tensors(chunk)
    worst, worst_max, n = 0.0, 0.0, 0
    for rule in chunk_rules(chunk.cfg, chunk.layer_ids, chunk.pre_process, chunk.post_process, chunk.experts):
        if rule.tied:  # the last stage's copy of the tied embedding
            rule = dataclasses.replace(rule, local="embed.weight", tied=False)
        rule = dataclasses.replace(rule, expert=None)  # a stacked expert's rule: both ways on its slice alone
        full = to_hf(rule, [ref[rule.local]], chunk.cfg)
        want = to_local(rule, [full[k] for k in rule.hf], chunk.cfg, ps.tp, ps.tp_rank)
        got = params["lm_head.weight" if rule.local not in params else rule.local].detach()
        worst = max(worst, ((got - want).norm() / want.norm().clamp_min(1e-12)).item())
        worst_max = max(worst_max, ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item())
        n += 1
    return worst, worst_max, n


__all__ = ["CFG", "DistributedOptimizer", "OptimizerConfig", "build_rank_chunk", "check_within_rounding",
           "loss_distance", "max_rel_diff", "reference", "train", "truth", "truth_of"]
