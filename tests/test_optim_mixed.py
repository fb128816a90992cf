"""fp16 loss scaling and overflow skips, bf16 parameters with fp32 master weights, and
proof that every forward after a step waits for each bucket's all-gather in forward order."""

from __future__ import annotations

import math

import pytest
import torch

import hfmeg.parallel.data_parallel as dopt
from helpers import make_ps
from hfmeg.errors import UnsupportedConfigError
from hfmeg.optim import DistributedOptimizer, OptimizerConfig
from hfmeg.optim.lr_schedule import LRScheduleConfig, lr_at
from hfmeg.parallel.launch import spawn
from bounds import within
from optim_harness import (CFG, batch, build_rank_chunk, check_within_rounding, loss_distance, micro_step, reference,
                           train, truth)
from tiny_models import save_tiny


def _owned_equal_master(opt, dtype):
    return all(torch.equal(opt._own(b, b.param_buf), opt._master_shard(b).to(dtype)) for b in opt.buckets)


def _fp16_skip(folder):
    ps = make_ps()
    chunk = build_rank_chunk(folder, ps, dtype=torch.float16)
    opt = DistributedOptimizer([chunk], ps, OptimizerConfig(initial_loss_scale=1024.0, **CFG))
    before = {n: p.detach().clone() for n, p in chunk.named_parameters()}
    ids, labels = batch(0, 0)
    # fp16 gradients overflow on one rank only: the step must be skipped on all.
    blow_up = 1e9 if ps.dp_rank == 0 else 1.0
    opt.scale_loss(chunk(ids, labels=labels).sum() * blow_up).backward()
    r1 = opt.step()
    unchanged = all(torch.equal(before[n], p) for n, p in chunk.named_parameters())
    micro_step(chunk, opt, ps, 1, 0, 60, True)
    r2 = opt.step()
    opt.wait_params()
    changed = all(not torch.equal(before[n], p) for n, p in chunk.named_parameters() if "norm" not in n)
    return dict(r1=r1, r2=r2, skipped=opt.skipped_steps, unchanged=unchanged, changed=changed,
                master=opt.master.dtype, param=chunk.embed.weight.dtype, synced=_owned_equal_master(opt, torch.float16))


def _bf16_vs_fp32(folder):
    ps = make_ps()
    cfg = OptimizerConfig(**CFG)
    ref_losses, _ = reference(folder, cfg, 1, 4, make_ps())
    chunk = build_rank_chunk(folder, ps, dtype=torch.bfloat16)
    opt = DistributedOptimizer([chunk], ps, cfg)
    losses = train(chunk, opt, ps, 1, 4)
    opt.wait_params()
    return dict(ref=ref_losses, bf16=losses, master=opt.master.dtype, param=chunk.embed.weight.dtype,
                synced=_owned_equal_master(opt, torch.bfloat16))


class LazyGather:
    """An all-gather that runs only when waited for: a missed wait leaves stale weights."""

    log: list = []

    def __init__(self, out, inp, group, tag):
        self.args = (out, inp, group, tag)

    def wait(self):
        LazyGather.log.append((self.args[0].data_ptr(), LazyGather.in_forward))
        real_all_gather(*self.args).wait()


real_all_gather = dopt.all_gather_async


def _forward_waits(folder):
    dopt.all_gather_async = LazyGather
    ps = make_ps()
    cfg = OptimizerConfig(**CFG)
    exact = truth(folder, cfg, 2, 4, make_ps())
    chunk = build_rank_chunk(folder, ps)
    chunk.register_forward_pre_hook(lambda *a: setattr(LazyGather, "in_forward", True))
    chunk.register_forward_hook(lambda *a: setattr(LazyGather, "in_forward", False))
    LazyGather.in_forward = False
    opt = DistributedOptimizer([chunk], ps, cfg)
    losses = train(chunk, opt, ps, 2, 4)
    order = [b.param_buf.data_ptr() for b in sorted(opt.buckets, key=lambda b: -b.index)]
    return dict(loss_rel=loss_distance(losses, exact.losses), rounding=exact.rounding, partial_losses=ps.dp * 2,
                log=LazyGather.log, forward_order=order, n_buckets=len(opt.buckets))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_tiny("llama3", tmp_path_factory.mktemp("mixed") / "m"))


def test_fp16_overflow_is_skipped_counted_and_backs_off(folder):
    for r in spawn(_fp16_skip, 2, folder):
        assert r["r1"].skipped and not math.isfinite(r["r1"].grad_norm) and r["r1"].loss_scale == 1024.0
        assert r["unchanged"] and r["skipped"] == 1
        assert not r["r2"].skipped and r["r2"].loss_scale == 512.0 and r["changed"]
        assert r["master"] == torch.float32 and r["param"] == torch.float16 and r["synced"]


def test_bf16_params_with_fp32_master_track_fp32_reference(folder):
    r = spawn(_bf16_vs_fp32, 2, folder)[0]
    assert r["master"] == torch.float32 and r["param"] == torch.bfloat16 and r["synced"]
    # Every run in launch.spawn ranks, one thread each whatever OMP_NUM_THREADS or the load: no thread count moves
    # these losses (docs/testing.md, bounds). 2e-2: ~5 bf16 eps (2^-8), the parameters' bf16 rounding at each step.
    within(max(abs(a - b) / b for a, b in zip(r["bf16"], r["ref"])), 2e-2, "bf16 params vs fp32 loss", r)


def test_every_forward_after_step_waits_for_each_bucket_in_forward_order(folder):
    r = spawn(_forward_waits, 2, folder)[0]
    # A stale bucket moves the loss by ~lr; a complete run is within fp32 rounding of the float64 run.
    check_within_rounding(None, None, r["loss_rel"], r["rounding"], r["partial_losses"], r)
    # Steps 0..2 are each followed by a forward; the last step's gathers are never waited for.
    assert len(r["log"]) == 3 * r["n_buckets"] and r["n_buckets"] > 3
    assert all(in_fwd for _, in_fwd in r["log"]), "a bucket was waited for outside the forward"
    for step in range(3):
        got = [ptr for ptr, _ in r["log"][step * r["n_buckets"]:(step + 1) * r["n_buckets"]]]
        assert got == r["forward_order"]


def test_lr_schedule_and_config_errors():
    cfg = LRScheduleConfig(warmup_steps=10, total_steps=110, decay="cosine", min_lr=1e-5)
    assert lr_at(0, 1e-3, cfg) == pytest.approx(1e-4)
    assert lr_at(9, 1e-3, cfg) == pytest.approx(1e-3)
    assert lr_at(60, 1e-3, cfg) == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5)
    assert lr_at(500, 1e-3, cfg) == pytest.approx(1e-5)
    assert lr_at(60, 1e-3, LRScheduleConfig(10, 110, "linear")) == pytest.approx(5e-4)
    with pytest.raises(UnsupportedConfigError, match="mode"):
        OptimizerConfig(mode="zero3")
