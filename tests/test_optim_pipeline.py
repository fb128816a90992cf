"""The optimizer under the real pipeline schedules, and proof that the overlap is real.

1. PP=2 x DP=2 (tied embeddings, so the embedding-group sum runs) trained by
   `hfmeg.parallel.pipeline.forward_backward` with `grad_sync=opt`, under 1F1B and
   the interleaved schedule (vpp=2: buckets per virtual chunk, `set_last_microbatch`
   called per chunk by the schedule), 4 micro-batches per DP rank, modes
   `overlapped` and `distributed`. After 3 steps every parameter and every loss must
   be as close to the same AdamW run in float64 as fp32 rounding puts the unsharded
   fp32 reference (`optim_harness.check_within_rounding`).
2. Launch order, not wall clock: in `overlapped` mode each bucket's reduce-scatter is
   launched during the last micro-batch's backward, before the gradient of layer 0
   (computed last) has been accumulated, and nothing is launched on earlier
   micro-batches; in `distributed` mode nothing is launched before backward ends.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers import make_ps
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.data.microbatch import MicroBatch
from hfmeg.optim import DistributedOptimizer, OptimizerConfig
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.pipeline import forward_backward
from hfmeg.parallel.state import ParallelState
from optim_harness import (CFG, ROWS, batch, build_rank_chunk, check_within_rounding, global_tokens, loss_distance,
                           max_rel_diff, micro_step, truth)
from tiny_models import save_tiny

STEPS, MICRO = 3, 4
CASES = [("1f1b", 1, "overlapped"), ("interleaved", 2, "overlapped"), ("interleaved", 2, "distributed")]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_tiny("llama3", tmp_path_factory.mktemp("optim_pp") / "m", tie_word_embeddings=True,
                         num_hidden_layers=4))


def _microbatches(step: int, ps: ParallelState) -> list[MicroBatch]:
    rows = ROWS // ps.dp
    mine = slice(ps.dp_rank * rows, (ps.dp_rank + 1) * rows)
    return [MicroBatch(input_ids=ids[mine], labels=labels[mine])
            for ids, labels in (batch(step, m) for m in range(MICRO))]


def _pipeline(folder):
    exact = truth(folder, OptimizerConfig(**CFG), MICRO, STEPS, make_ps())
    out = []
    for schedule, vpp, mode in CASES:
        ps = make_ps(pp=2, vpp=vpp)
        chunks = load_chunks(HFCheckpoint(folder), ps)
        opt = DistributedOptimizer(chunks, ps, OptimizerConfig(mode=mode, **CFG))
        losses = []
        for step in range(STEPS):
            loss = forward_backward(chunks, ps, _microbatches(step, ps), schedule=schedule,
                                    num_tokens=global_tokens(step, MICRO), grad_sync=opt)
            opt.step()
            t = torch.tensor([loss if loss is not None else 0.0], dtype=torch.float64)
            dist.all_reduce(t)  # the last stage's DP ranks hold the loss
            losses.append(t.item())
        opt.wait_params()
        rel, rel_max = (max(d[i] for d in (max_rel_diff(c, ps, exact.params) for c in chunks)) for i in (0, 1))
        out.append(dict(case=(schedule, vpp, mode), rel=rel, rel_max=rel_max,
                        loss_rel=loss_distance(losses, exact.losses), rounding=exact.rounding, dp=ps.dp,
                        chunks=len(chunks),
                        chunk_of_bucket=sorted({b.chunk for b in opt.buckets})))
        opt.data_parallel.grad_sync.remove_hooks()
    return out


def test_pp2_dp2_real_schedules_match_adamw_reference(folder):
    rows = [r for rank in spawn(_pipeline, 4, folder) for r in rank]
    assert len(rows) == 4 * len(CASES)
    for r in rows:
        vpp = r["case"][1]
        assert r["chunks"] == vpp and r["chunk_of_bucket"] == list(range(vpp)), r  # buckets per virtual chunk
        check_within_rounding(r["rel"], r["rel_max"], r["loss_rel"], r["rounding"], r["dp"] * MICRO, r)


def _launch_order(folder):
    out = {}
    for mode in ("overlapped", "distributed"):
        ps = make_ps()
        chunk = build_rank_chunk(folder, ps)
        opt = DistributedOptimizer([chunk], ps, OptimizerConfig(mode=mode, **CFG))
        events: list[tuple] = []
        sync = opt.data_parallel.grad_sync
        launch = sync._launch
        sync._launch = lambda b: (events.append(("launch", b.index)), launch(b))[1]
        # Registered after the optimizer's hooks, so it runs once layer 0's gradient has been accumulated.
        layer0 = dict(chunk.named_parameters())["layers.0.attn.qkv.weight"]
        layer0.register_post_accumulate_grad_hook(lambda p: events.append(("layer0",)))
        ntok = global_tokens(0, 2)
        for m in range(2):
            events.append(("backward", m))
            micro_step(chunk, opt, ps, 0, m, ntok, m == 1)
        events.append(("step",))
        opt.step()
        opt.wait_params()
        out[mode] = dict(events=events, n_buckets=len(opt.buckets),
                         layer0_bucket=next(b.index for b in opt.buckets for s in b.slots
                                            if s.name == "layers.0.attn.qkv.weight"))
    return out


def test_overlapped_reduce_scatter_starts_during_backward(folder):
    r = spawn(_launch_order, 2, folder)[0]
    ev = r["overlapped"]["events"]
    last_bw, layer0 = ev.index(("backward", 1)), max(i for i, e in enumerate(ev) if e == ("layer0",))
    launches = [i for i, e in enumerate(ev) if e[0] == "launch"]
    assert len(launches) == r["overlapped"]["n_buckets"] > 3
    assert all(i > last_bw for i in launches), "a bucket was launched on a non-final micro-batch"
    # Buckets follow gradient-ready order: the ones before layer 0's launch while autograd still has layer 0
    # ahead of it (layer 0's own bucket may launch from the optimizer's hook, which runs before ours).
    early = [ev[i][1] for i in launches if i < layer0]
    assert all(b <= r["overlapped"]["layer0_bucket"] for b in early), ev
    assert len([b for b in early if b < r["overlapped"]["layer0_bucket"]]) >= 2, ev
    assert [ev[i][1] for i in launches] == sorted(ev[i][1] for i in launches)
    ev = r["distributed"]["events"]
    step = ev.index(("step",))
    assert all(i > step for i, e in enumerate(ev) if e[0] == "launch"), "distributed mode launched during backward"
