"""Optimizer-state checkpoints: save at DP=4, load at DP=2, training continues identically."""

from __future__ import annotations

import numpy as np
import torch.distributed as dist

from helpers import make_ps
from hfmeg.optim import DistributedOptimizer, OptimizerConfig
from hfmeg.optim.state_io import load_optimizer_state, save_optimizer_state
from hfmeg.parallel.launch import spawn
from optim_harness import CFG, build_rank_chunk, train
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


def _rel(a, b):
    return max(float(np.linalg.norm(a[n] - b[n]) / np.linalg.norm(b[n])) for n in b)


def test_save_dp4_load_dp2_continues_identically(tmp_path):
    folder = str(save_tiny("llama3", tmp_path / "model"))
    ckpt = tmp_path / "optim"
    losses4, params4, bytes4 = spawn(_save_then_continue, 4, folder, str(ckpt))[0]
    assert len(list(ckpt.glob("optim_*.safetensors"))) == 4
    for mode in ("overlapped", "ddp"):
        losses2, params2, bytes2 = spawn(_load_and_continue, 2, folder, str(ckpt), mode)[0]
        assert max(abs(a - b) / abs(b) for a, b in zip(losses2, losses4)) <= 1e-6, (mode, losses2, losses4)
        assert _rel(params2, params4) <= 1e-6, mode
        assert bytes2 > bytes4  # half the DP ranks: each holds about twice the state (ddp: all of it)
