"""PowerSGD on the data-parallel gradient path (hfmeg/parallel/powersgd.py), gloo ranks on CPU.

- Compression configured but starting after the run: bit-identical to no compression.
- Rank = full (every matrix compressed at min(m, n)): the sum is exact up to rounding, so
  10 steps (compressed from step 3) match the uncompressed run within rounding (both fp32 runs
  within `optim_harness.check_within_rounding` of the float64 run), at DP=4 and at
  TP=2 x DP=2 with sequence parallelism, in the three modes, and at PP=2 x DP=2 with tied
  embeddings, with gradient accumulation; and with expert parallelism (a tiny Mixtral at
  EP2 x expert-DP 2 and EP4), where expert buckets are compressed over their own group.
- Error feedback: the owned shards of the sums and the residuals follow a float64
  simulation of every rank, and nothing is lost: the sums sent plus the residuals left
  add up to every gradient of every rank.
- Resume from checkpoints written before and after the switch reproduces the
  uninterrupted run bit for bit.
- A skipped (non-finite) step restarts Q and the residuals, so NaN does not stay in them.
- Bad settings are refused naming the field; the start step defaults to 10 % of the run.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from helpers import make_ps
from hfmeg.errors import UnsupportedConfigError
from hfmeg.optim.state_io import load_optimizer_state, save_optimizer_state
from hfmeg.parallel.data_parallel import DataParallel
from hfmeg.parallel.launch import spawn
from hfmeg.train.config import LoopArgs, TrainConfig
from optim_harness import (CFG, DistributedOptimizer, OptimizerConfig, batch, build_rank_chunk, check_within_rounding,
                           loss_distance, train, truth)
from tiny_models import save_tiny

STEPS = 10


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(save_tiny("llama3", tmp_path_factory.mktemp("powersgd") / "model"))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return str(save_tiny("mixtral", tmp_path_factory.mktemp("powersgd") / "mixtral", output_router_logits=False))


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory):
    """Tied embeddings: at PP=2 both stages' copies are compressed, then summed over the embedding group."""
    return str(save_tiny("llama3", tmp_path_factory.mktemp("powersgd") / "tied", tie_word_embeddings=True))


def _run(folder, ps, cfg: OptimizerConfig, ga: int, steps: int = STEPS):
    chunk = build_rank_chunk(folder, ps)
    opt = DistributedOptimizer([chunk], ps, cfg)
    losses = train(chunk, opt, ps, ga, steps)
    opt.wait_params()
    return chunk, opt, losses


def _late_start_is_bit_identical(folder):
    ps = make_ps()
    plain, _, plain_losses = _run(folder, ps, OptimizerConfig(**CFG), ga=2)
    late = OptimizerConfig(**CFG, compression="powersgd", powersgd_rank=1, compression_start_step=STEPS)
    chunk, opt, losses = _run(folder, ps, late, ga=2)
    assert opt.data_parallel.compressor.plans  # configured, with matrices to compress
    same = all(torch.equal(a, b) for a, b in zip(chunk.parameters(), plain.parameters()))
    return same and losses == plain_losses


def test_compression_starting_after_the_run_is_bit_identical(model):
    assert all(spawn(_late_start_is_bit_identical, 2, model))


def _rel(chunk, ref) -> dict[str, float]:
    """Worst per-tensor ||ours - ref|| / ||ref|| and max|ours - ref| / max|ref| between two chunks of the same
    layout (as `optim_harness.max_rel_diff` measures against the float64 run)."""
    pairs = list(zip(chunk.parameters(), ref.parameters()))
    return dict(rel=max(((a - b).norm() / b.norm()).item() for a, b in pairs),
                rel_max=max(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs))


def _rounding(*folders):
    """What fp32 rounding does to these 10 steps (GA 2) on this CPU: the unsharded fp32 AdamW run's distance from
    the float64 run, per model."""
    return [truth(f, OptimizerConfig(**CFG), 2, STEPS, make_ps(world=1)).rounding for f in folders]


def _check_full_rank(r, rounding, ga: int = 2) -> None:
    """Full-rank PowerSGD reconstructs each gradient up to fp32 rounding: the compressed and the uncompressed run
    are two sharded fp32 runs, each within rounding of the float64 run, hence within twice that of each other."""
    check_within_rounding(r["rel"], r["rel_max"], r["loss_rel"], rounding, r["dp"] * ga, r, runs=2)


def _full_rank(folder, tied):
    out = []
    modes = ("overlapped", "ddp", "distributed")
    for layout, model, mode_list in ((dict(tp=1), folder, modes), (dict(tp=2, sp=True), folder, modes),
                                     (dict(tp=1, pp=2), tied, ("overlapped",))):
        ps = make_ps(**layout)
        plain, _, plain_losses = _run(model, ps, OptimizerConfig(**CFG), ga=2)
        for mode in mode_list:
            cfg = OptimizerConfig(**{**CFG, "mode": mode}, compression="powersgd", powersgd_rank=10**6,
                                  compression_start_step=3, min_compression_rate=0.0)
            chunk, opt, losses = _run(model, ps, cfg, ga=2)
            out.append(dict(layout=layout, mode=mode, **_rel(chunk, plain), dp=ps.dp,
                            loss_rel=loss_distance(losses, plain_losses), tied=model == tied,
                            compressed=len(opt.data_parallel.compressor.matrices())))
    return out


def test_full_rank_matches_uncompressed(model, tied_model):
    rounding = dict(zip((False, True), spawn(_rounding, 1, model, tied_model)[0]))
    rows = [r for rank in spawn(_full_rank, 4, model, tied_model) for r in rank]
    assert len(rows) == 4 * (2 * 3 + 1)
    for r in rows:
        assert r["compressed"] > 0, r
        _check_full_rank(r, rounding[r["tied"]])


def _full_rank_expert_parallel(folder):
    out = []
    for ep, mode in ((2, "overlapped"), (2, "ddp"), (4, "overlapped")):
        ps = make_ps(ep=ep)
        plain, _, plain_losses = _run(folder, ps, OptimizerConfig(**{**CFG, "mode": mode}), ga=2)
        cfg = OptimizerConfig(**{**CFG, "mode": mode}, compression="powersgd", powersgd_rank=10**6,
                              compression_start_step=3, min_compression_rate=0.0)
        chunk, opt, losses = _run(folder, ps, cfg, ga=2)
        dpx = opt.data_parallel
        groups = {b.expert: dpx.compressor.plans[b.index].group for b in dpx.buckets if dpx.compressor.compresses(b)}
        out.append(dict(ep=ep, mode=mode, **_rel(chunk, plain), dp=ps.dp, loss_rel=loss_distance(losses, plain_losses),
                        expert_compressed=True in groups, dense_compressed=False in groups,
                        expert_group_is_edp=groups.get(True) is ps.expert_dp_group,
                        dense_group_is_dp=groups[False] is ps.dp_group))
    return out


def test_expert_parallel_compresses_each_bucket_over_its_own_group(mixtral):
    """EP2 x expert-DP 2 (DP 4): dense buckets are compressed over the 4 DP ranks and expert buckets over the 2
    ranks holding the same experts; at full rank both are exact, so 10 steps match uncompressed within rounding.
    At EP4 no rank shares its experts: they are not summed, and only the dense buckets are compressed."""
    rounding = spawn(_rounding, 1, mixtral)[0][0]
    rows = [r for rank in spawn(_full_rank_expert_parallel, 4, mixtral) for r in rank]
    for r in rows:
        _check_full_rank(r, rounding)
        assert r["dense_compressed"] and r["dense_group_is_dp"], r
        assert r["expert_compressed"] == (r["ep"] == 2), r
        assert r["expert_group_is_edp"] or r["ep"] == 4, r


def _grads(step: int, dp: int, slots) -> dict[str, torch.Tensor]:
    """Every DP rank's gradient of every slot at `step` (float64, [dp, *shape]), the same on every rank."""
    out = {}
    for i, s in enumerate(slots):
        g = torch.Generator().manual_seed(10_000 * step + 100 * i)
        out[s.name] = torch.randn(dp, *s.param.shape, generator=g, dtype=torch.float64)
    return out


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    # fp32 against the float64 simulation over 3 steps: 1e-5 = 84 eps32 of the value (or of 1 for values under 1);
    # computed in launch.spawn ranks, one thread each whatever OMP_NUM_THREADS: no thread count moves it.
    return (got.double() - want).abs().max().item() <= 1e-5 * max(want.abs().max().item(), 1.0)


def _error_feedback(folder):
    """Three compressed steps at rank 2 with known gradients, through the data-parallel wrapper."""
    ps = make_ps()
    dp = DataParallel([build_rank_chunk(folder, ps)], ps, "overlapped", 5000, powersgd_rank=2)
    dp.set_compression(True)
    slots = [s for b in dp.buckets for s in b.slots]
    mats = {mat.slot.name: mat for _, mat in dp.compressor.matrices()}
    mixed = [b for b in dp.buckets if dp.compressor.compresses(b) and len(dp.compressor.plans[b.index].exact)]
    q = {n: mat.q.double().clone() for n, mat in mats.items()}  # the seeded start, identical on every rank
    resid = {s.name: torch.zeros(ps.dp, *s.param.shape, dtype=torch.float64) for s in slots}  # every rank's E_j
    sent = [torch.zeros(b.shard_size, dtype=torch.float64) for b in dp.buckets]  # owned shards of the sums
    total = [torch.zeros(b.size, dtype=torch.float64) for b in dp.buckets]  # every gradient of every rank
    ok = []
    for step in range(3):
        g = _grads(step, ps.dp, slots)
        for s in slots:
            s.param.main_grad.add_(g[s.name][ps.dp_rank].float())  # as a backward would
        dp.finish_grad_sync()
        want = {}
        for s in slots:  # the float64 simulation of every rank
            m = g[s.name] + resid[s.name]
            if s.name in mats:
                p = torch.linalg.qr((m @ torch.linalg.qr(q[s.name]).Q).sum(0)).Q
                q[s.name] = (m.transpose(1, 2) @ p).sum(0)
                want[s.name] = p @ q[s.name].T
                resid[s.name] = m - p @ (p.T @ m)
            else:
                want[s.name] = m.sum(0)
        for i, b in enumerate(dp.buckets):
            flat = torch.zeros(b.size, dtype=torch.float64)
            for s in b.slots:
                flat[s.offset : s.offset + s.numel] = want[s.name].view(-1)
                total[i][s.offset : s.offset + s.numel] += g[s.name].sum(0).view(-1)
            ok.append(_close(dp.owned(b, b.grad_buf), dp.owned(b, flat)))
            sent[i] += dp.owned(b, b.grad_buf).double()
        dp.zero_grad()
        ok += [_close(mat.grad, resid[n][ps.dp_rank]) for n, mat in mats.items()]  # residual kept in main grad
    for i, b in enumerate(dp.buckets):  # nothing lost: the sums sent + every rank's residual = every gradient
        left = b.grad_buf.clone()
        dist.all_reduce(left)
        ok.append(_close(sent[i] + dp.owned(b, left).double(), dp.owned(b, total[i])))
    return all(ok), len(mats), len(mixed)


def test_error_feedback_carries_the_residual_over(model):
    for passed, compressed, mixed in spawn(_error_feedback, 2, model):
        assert passed
        assert compressed > 0 and mixed > 0  # matrices, and buckets that also sum vectors exactly


def _resume(folder, ckpt):
    """Save before (step 2) and after (step 4) the switch at step 3; resumed runs must match bit for bit."""
    ps = make_ps()
    out = []
    for mode in ("overlapped", "ddp"):
        cfg = OptimizerConfig(**{**CFG, "mode": mode}, compression="powersgd", powersgd_rank=2,
                              compression_start_step=3)
        chunk = build_rank_chunk(folder, ps)
        opt = DistributedOptimizer([chunk], ps, cfg)
        losses = train(chunk, opt, ps, 2, 2)
        save_optimizer_state(opt, f"{ckpt}/{mode}/2")
        losses += train(chunk, opt, ps, 2, 2, first_step=2)
        save_optimizer_state(opt, f"{ckpt}/{mode}/4")
        losses += train(chunk, opt, ps, 2, 2, first_step=4)
        opt.wait_params()
        for first in (2, 4):
            resumed = build_rank_chunk(folder, ps)  # initial weights: loading brings the trained ones back
            opt2 = DistributedOptimizer([resumed], ps, cfg)
            load_optimizer_state(opt2, f"{ckpt}/{mode}/{first}")
            more = train(resumed, opt2, ps, 2, 6 - first, first_step=first)
            opt2.wait_params()
            out.append(more == losses[first:]
                       and all(torch.equal(a, b) for a, b in zip(resumed.parameters(), chunk.parameters())))
    return out


def test_resume_across_the_switch_is_exact(model, tmp_path):
    for rank in spawn(_resume, 2, model, str(tmp_path)):
        assert rank == [True] * 4


def _non_finite_step(folder):
    """A step with NaN gradients is skipped and restarts Q and the residuals; training goes on."""
    ps = make_ps()
    cfg = OptimizerConfig(**CFG, compression="powersgd", powersgd_rank=2, compression_start_step=0)
    chunk = build_rank_chunk(folder, ps)
    opt = DistributedOptimizer([chunk], ps, cfg)
    train(chunk, opt, ps, 1, 2)
    ids, labels = batch(2, 0)
    (chunk(ids, labels=labels).sum() * float("nan")).backward()
    skipped = opt.step().skipped
    fresh = DistributedOptimizer([build_rank_chunk(folder, ps)], ps, cfg).data_parallel.compressor.state_dict()
    restarted = all(torch.equal(t, fresh[k]) for k, t in opt.data_parallel.compressor.state_dict().items())
    losses = train(chunk, opt, ps, 1, 2, first_step=3)
    finite = all(torch.isfinite(p).all() for p in chunk.parameters()) and all(map(math.isfinite, losses))
    return skipped, restarted, finite, opt.skipped_steps


def test_a_skipped_step_restarts_the_compression_state(model):
    for rank in spawn(_non_finite_step, 2, model):
        assert rank == (True, True, True, 1)


@pytest.mark.parametrize("field, value, expect", [
    ("compression", "topk", "optimizer field compression: 'topk'"),
    ("powersgd_rank", 0, "optimizer field powersgd_rank: must be >= 1"),
    ("compression_start_step", -1, "optimizer field compression_start_step: must be >= 0"),
    ("min_compression_rate", float("nan"), "optimizer field min_compression_rate"),
])
def test_bad_settings_name_the_field(field, value, expect):
    with pytest.raises(UnsupportedConfigError, match=expect):
        OptimizerConfig(**{field: value})


def test_start_step_must_be_set_and_fp16_is_refused(model):
    chunk = build_rank_chunk(model, make_ps())
    with pytest.raises(UnsupportedConfigError, match="optimizer field compression_start_step: must be set"):
        DistributedOptimizer([chunk], make_ps(), OptimizerConfig(compression="powersgd"))
    chunk = build_rank_chunk(model, make_ps(), dtype=torch.float16)
    with pytest.raises(UnsupportedConfigError, match="optimizer field compression: powersgd does not support fp16"):
        DistributedOptimizer([chunk], make_ps(), OptimizerConfig(compression="powersgd", compression_start_step=0))


def test_start_step_defaults_to_a_tenth_of_the_run():
    assert TrainConfig(train=LoopArgs(max_steps=250)).optim.compression_start_step == 25
    cfg = TrainConfig(optim=OptimizerConfig(compression_start_step=7), train=LoopArgs(max_steps=250))
    assert cfg.optim.compression_start_step == 7
