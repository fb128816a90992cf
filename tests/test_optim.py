"""The distributed optimizer against single-process torch.optim.AdamW (fp32, gloo).

One 4-rank world runs DP=4, TP=2 x DP=2 (sequence parallel), PP=2 x DP=2 (tied
embeddings, so the embedding-group sum is exercised) and TP=4 x DP=1, each in the
three modes with gradient accumulation 1 and 4, clipping and weight-decay
exclusions on, small buckets so parameters straddle shard boundaries, for 3 steps. Every
parameter and every step's loss must be as close to the same AdamW run in float64 as fp32
rounding puts the unsharded fp32 reference (`optim_harness.check_within_rounding`). The references
(fp32 and float64, per model and GA) are trained once in the test process, not on each rank.

The settings (`CFG`) and why they are well conditioned: optim_harness.py.
"""

from __future__ import annotations

import pytest

from helpers import make_ps
from hfmeg.optim import DistributedOptimizer, OptimizerConfig
from hfmeg.parallel.launch import spawn
from optim_harness import CFG, build_rank_chunk, check_within_rounding, loss_distance, max_rel_diff, train, truth
from tiny_models import save_tiny

# Step 1 starts from fresh moments and bias corrections; steps 2 and 3 run with the state the previous steps left
# (moments, the main grads zeroed and refilled, in `overlapped` the previous step's all-gathers still in flight when
# the next forward starts), which is every path a longer run takes again; a stale, missing or doubly applied update
# shows from step 2 on (~lr / |param| >> the bound). 10 steps cost 3x the collectives for no other path.
STEPS = 3
LAYOUTS = [dict(tp=1), dict(tp=2, sp=True), dict(tp=1, pp=2), dict(tp=4)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("optim")
    return {"untied": str(save_tiny("llama3", root / "untied")),
            "tied": str(save_tiny("llama3", root / "tied", tie_word_embeddings=True))}


def _truths(models) -> dict:
    """{(folder, ga): the float64 AdamW run and the fp32 one's rounding}, trained once here in the test process (the
    reference is the same whatever the mode or layout)."""
    ps1 = make_ps(world=1)
    return {(folder, ga): truth(folder, OptimizerConfig(**CFG), ga, STEPS, ps1)
            for folder in models.values() for ga in (1, 4)}


def _parity(models, refs):
    out = []
    for layout in LAYOUTS:
        ps = make_ps(**layout)
        folder = models["tied" if ps.pp > 1 else "untied"]
        for ga in (1, 4):
            for mode in ("ddp", "distributed", "overlapped"):
                cfg = OptimizerConfig(mode=mode, **CFG)
                exact = refs[folder, ga]
                chunk = build_rank_chunk(folder, ps)
                n_params = sum(p.numel() for p in chunk.parameters())
                opt = DistributedOptimizer([chunk], ps, cfg)
                losses = train(chunk, opt, ps, ga, STEPS)
                opt.wait_params()  # the last step's all-gathers are otherwise waited by the next forward
                rel, rel_max, n = max_rel_diff(chunk, ps, exact.params)
                padded = sum(b.size for b in opt.buckets)
                storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                            for adamw in opt.optimizers.values() for g in adamw.param_groups for p in g["params"]
                            for t in (p, adamw.state[p]["exp_avg"], adamw.state[p]["exp_avg_sq"])}
                out.append(dict(layout=layout, ga=ga, mode=mode, rel=rel, rel_max=rel_max, n=n,
                                loss_rel=loss_distance(losses, exact.losses), rounding=exact.rounding,
                                state_bytes=sum(storages.values()), n_params=n_params, padded=padded,
                                n_buckets=len(opt.buckets), dp=ps.dp, shards=opt.shards))
    return out


def test_matches_adamw_reference_all_layouts_and_modes(models):
    rows = [r for rank in spawn(_parity, 4, models, _truths(models)) for r in rank]
    assert len(rows) == 4 * len(LAYOUTS) * 2 * 3
    for r in rows:
        assert r["n"] > 0, r
        check_within_rounding(r["rel"], r["rel_max"], r["loss_rel"], r["rounding"], r["dp"] * r["ga"], r)
        # Optimizer memory: (master + m + v) / DP for the sharded modes, plus < DP elements of padding per bucket.
        shards = r["dp"] if r["mode"] != "ddp" else 1
        assert r["shards"] == shards
        assert r["state_bytes"] == 12 * r["padded"] // shards, r
        assert 0 <= r["padded"] - r["n_params"] < shards * r["n_buckets"], r


def _freed_after_drop(folder) -> bool:
    import gc
    import weakref

    ps = make_ps()
    chunk = build_rank_chunk(folder, ps)
    opt = DistributedOptimizer([chunk], ps, OptimizerConfig(mode="overlapped", **CFG))
    train(chunk, opt, ps, 1, 1)
    param = weakref.ref(next(chunk.parameters()))
    del chunk, opt
    gc.collect()
    return param() is None


def test_a_dropped_model_and_optimizer_are_freed(models):
    """The gradient hooks live on the parameters, in C++, out of the garbage collector's sight: they must not
    hold the wrapper (and through its buckets the parameters), or no model a process wraps is ever freed."""
    assert spawn(_freed_after_drop, 1, models["untied"]) == [True]


def _compiled(folder):
    """DP2 overlapped, each decoder layer's forward compiled as one graph (`aot_eager`: Dynamo and AOTAutograd
    without Inductor's code generation, minutes on 2 CPU cores), 3 steps of GA 2."""
    ps, cfg = make_ps(), OptimizerConfig(mode="overlapped", **CFG)
    exact = truth(folder, cfg, 2, 3, make_ps(world=1))
    chunk = build_rank_chunk(folder, ps, compile_backend="aot_eager")
    opt = DistributedOptimizer([chunk], ps, cfg)
    losses = train(chunk, opt, ps, 2, 3)  # steps 2 and 3 start with the previous step's all-gathers in flight
    opt.wait_params()
    rel, rel_max, n = max_rel_diff(chunk, ps, exact.params)
    return dict(rel=rel, rel_max=rel_max, n=n, loss_rel=loss_distance(losses, exact.losses), rounding=exact.rounding)


def test_compiled_decoder_layers_train_like_adamw(models):
    """Compiled layers (their fused weight-gradient writes inside the graph, the parameter waits outside it) take
    the steps the float64 AdamW run takes, within fp32 rounding like every eager layout."""
    for r in spawn(_compiled, 2, models["untied"]):
        assert r["n"] > 0, r
        check_within_rounding(r["rel"], r["rel_max"], r["loss_rel"], r["rounding"], 2 * 2, r)
