"""Optimizer-state checkpoints: save at DP=4, load at DP=2, training continues identically.

"Identically" up to fp32 rounding: DP 2 and DP 4 sum gradients in another order, so the two runs are
each as close to the float64 run as fp32 rounding allows (`optim_harness.check_within_rounding`), and
to each other within twice that. A lost or misplaced piece of state is orders larger."""

from __future__ import annotations

import numpy as np
import torch.distributed as dist

from helpers import make_ps
from hfmeg.optim import DistributedOptimizer, OptimizerConfig
from hfmeg.optim.state_io import load_optimizer_state, save_optimizer_state
from hfmeg.parallel.launch import spawn
from optim_harness import CFG, build_rank_chunk, check_within_rounding, loss_distance, train, truth
from tiny_models import save_tiny

GA, FIRST, MORE = 2, 4, 4


def _params(chunk, opt):
    opt.wait_params()
    return {n: p.detach().numpy().copy() for n, p in chunk.named_parameters()}  # tensors would travel as shm


def _save_then_continue(folder, ckpt):
    ps = make_ps()
    chunk = build_rank_chunk(folder, ps)
    opt = DistributedOptimizer([chunk], ps, OptimizerConfig(**CFG))
    train(chunk, opt, ps, GA, FIRST)
    save_optimizer_state(opt, ckpt)
    dist.barrier()
    losses = train(chunk, opt, ps, GA, MORE, first_step=FIRST)
    return losses, _params(chunk, opt), opt.state_bytes()


def _load_and_continue(folder, ckpt, mode):
    ps = make_ps()
    chunk = build_rank_chunk(folder, ps)  # initial weights: loading must bring the trained ones back
    opt = DistributedOptimizer([chunk], ps, OptimizerConfig(mode=mode, **CFG))
    load_optimizer_state(opt, ckpt)
    losses = train(chunk, opt, ps, GA, MORE, first_step=FIRST)
    return losses, _params(chunk, opt), opt.state_bytes()


def _rel(a, b) -> tuple[float, float]:
    return (max(float(np.linalg.norm(a[n] - b[n]) / np.linalg.norm(b[n])) for n in b),
            max(float(np.abs(a[n] - b[n]).max() / np.abs(b[n]).max()) for n in b))


def _rounding(folder):
    return truth(folder, OptimizerConfig(**CFG), GA, FIRST + MORE, make_ps(world=1)).rounding


def test_save_dp4_load_dp2_continues_identically(tmp_path):
    folder = str(save_tiny("llama3", tmp_path / "model"))
    ckpt = tmp_path / "optim"
    rounding = spawn(_rounding, 1, folder)[0]
    losses4, params4, bytes4 = spawn(_save_then_continue, 4, folder, str(ckpt))[0]
    assert len(list(ckpt.glob("optim_*.safetensors"))) == 4
    for mode in ("overlapped", "ddp"):
        losses2, params2, bytes2 = spawn(_load_and_continue, 2, folder, str(ckpt), mode)[0]
        rel, rel_max = _rel(params2, params4)
        check_within_rounding(rel, rel_max, loss_distance(losses2, losses4), rounding, 4 * GA, (mode, rel, rel_max),
                              runs=2)
        assert bytes2 > bytes4  # half the DP ranks: each holds about twice the state (ddp: all of it)
