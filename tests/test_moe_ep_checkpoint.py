"""Expert-parallel checkpoints: every expert saved once, exported bit-exactly, resumed at another EP size.

A tiny Mixtral (4 experts) trains 3 steps at EP2 in a 4-process gloo world (DP 4, so
expert state is also sharded over an expert-DP group of 2) and is saved as the trainer
saves (model shards through `mp_save`, optimizer shards through `state_io`). Then:
- the rank folder holds DP rank 0's `model.safetensors` and DP rank 1's experts 2-3 in
  `model-experts-002-003.safetensors`;
- exported to HF it is bit-identical to an EP=1 save of the same weights, and to the live
  parameters;
- resumed at EP4 and at EP1 (model and optimizer state re-partitioned by name), and after
  `reshard_training_checkpoint` to TP2 at TP2 x EP2, it continues as the uninterrupted EP2
  run does; so does a checkpoint of the same run in `ddp` mode (where each EP rank of DP
  rank 0's EP group writes the optimizer state of its own experts) resumed at EP4.
"""

from __future__ import annotations

import json

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from convert_helpers import assert_same_tensors
from helpers import make_ps
from hfmeg.checkpoint.convert import mp_to_hf
from hfmeg.checkpoint.load import load_chunks
from hfmeg.checkpoint.mp_layout import iteration_dir_name
from hfmeg.checkpoint.mp_reader import MPCheckpoint
from hfmeg.checkpoint.mp_save import chunks_layout, staged_save, write_model_shard
from hfmeg.optim.state_io import load_optimizer_state, save_optimizer_state
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.stored_names import stored_tensors
from hfmeg.train.checkpointing import STATE_FILE
from hfmeg.train.parts import reshard_training_checkpoint
from optim_harness import (CFG, DistributedOptimizer, OptimizerConfig, build_rank_chunk, check_within_rounding,
                           loss_distance, train, truth)
from tiny_models import save_tiny

STEPS, GA = 3, 2


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return save_tiny("mixtral", tmp_path_factory.mktemp("moe_ep_ckpt") / "m", output_router_logits=False)


def _save(chunks, ps, opt, root: Path, step: int, hf_side: Path) -> Path:
    layout = chunks_layout(chunks, ps, step)
    with staged_save(layout, ps, root, hf_side) as folder:
        write_model_shard(chunks, ps, layout, folder)
        if opt is not None:
            save_optimizer_state(opt, folder / "optim")
            if ps.rank == 0:  # what makes it a training checkpoint for reshard_training_checkpoint
                (folder / STATE_FILE).write_text(json.dumps({"step": step, "data": {}, "config": {}}))
    return root / iteration_dir_name(step)


def _trained(folder, ps, cfg, steps):
    chunk = build_rank_chunk(folder, ps)
    opt = DistributedOptimizer([chunk], ps, cfg)
    losses = train(chunk, opt, ps, GA, steps)
    opt.wait_params()
    opt.data_parallel.grad_sync.remove_hooks()
    return chunk, opt, losses


def _save_export_resume(folder: Path, out: Path):
    cfg = OptimizerConfig(mode="overlapped", **CFG)
    ps = make_ps(ep=2)
    _, _, uninterrupted = _trained(folder, ps, cfg, 2 * STEPS)
    chunk, opt, _ = _trained(folder, ps, cfg, STEPS)
    saved = _save([chunk], ps, opt, out / "ep2", STEPS, folder)
    # The same weights saved at EP=1, and both exported.
    ep1 = load_chunks(MPCheckpoint(saved), make_ps(ep=1))
    saved_ep1 = _save(ep1, make_ps(ep=1), None, out / "ep1", STEPS, folder)
    if dist.get_rank() == 0:
        mp_to_hf(saved, out / "hf_ep2")
        mp_to_hf(saved_ep1, out / "hf_ep1")
    dist.barrier()
    exported = stored_tensors(build_rank_chunk(out / "hf_ep2", make_ps(ep=1)))
    exact = all(torch.equal(t, exported[n]) for n, t in stored_tensors(chunk).items())
    if dist.get_rank() == 0:
        reshard_training_checkpoint(saved, out / "tp2", tp=2, pp=1)
    dist.barrier()
    ddp, ddp_opt, _ = _trained(folder, ps, OptimizerConfig(mode="ddp", **CFG), STEPS)
    saved_ddp = _save([ddp], ps, ddp_opt, out / "ddp", STEPS, folder)
    resumed = {}
    for name, source, tp, ep in (("ep4", saved, 1, 4), ("ep1", saved, 1, 1), ("tp2_ep2", out / "tp2", 2, 2),
                                 ("ddp_to_ep4", saved_ddp, 1, 4)):
        ps_r = make_ps(tp=tp, ep=ep)
        source = MPCheckpoint(source)
        chunks = load_chunks(source, ps_r)
        opt_r = DistributedOptimizer(chunks, ps_r, cfg)
        load_optimizer_state(opt_r, source.folder / "optim")
        resumed[name] = train(chunks[0], opt_r, ps_r, GA, STEPS, first_step=STEPS)
        opt_r.data_parallel.grad_sync.remove_hooks()
    files = sorted(p.name for p in (saved / "mp_rank_00").iterdir())
    return dict(uninterrupted=uninterrupted, resumed=resumed, exact=exact, files=files, saved=str(saved))


def _rounding(folder):
    return truth(folder, OptimizerConfig(**CFG), GA, 2 * STEPS, make_ps(world=1)).rounding


def test_ep_checkpoint_exports_exactly_and_resumes_at_another_ep(mixtral, tmp_path):
    rounding = spawn(_rounding, 1, mixtral)[0]
    results = spawn(_save_export_resume, 4, mixtral, tmp_path)
    r = results[0]
    assert r["files"] == ["model-experts-002-003.safetensors", "model.safetensors"], r["files"]
    assert all(x["exact"] for x in results)
    assert assert_same_tensors(tmp_path / "hf_ep1", tmp_path / "hf_ep2") > 0
    want = r["uninterrupted"][STEPS:]
    assert len(r["resumed"]) == 4
    for name, losses in r["resumed"].items():
        # Two sharded fp32 runs (the resumed one sums over another layout), each within rounding of float64.
        check_within_rounding(None, None, loss_distance(losses, want), rounding, 4 * GA, (name, losses, want),
                              runs=2)
