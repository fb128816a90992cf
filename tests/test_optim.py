"""The distributed optimizer against single-process torch.optim.AdamW (fp32, gloo).

One 4-rank world runs DP=4, TP=2 x DP=2 (sequence parallel), PP=2 x DP=2 (tied
embeddings, so the embedding-group sum is exercised) and TP=4 x DP=1, each in the
three modes with gradient accumulation 1 and 4, clipping and weight-decay
exclusions on, small buckets so parameters straddle shard boundaries, for 10 steps.

The bound comes from the arithmetic, not from one machine: the same AdamW run in float64
is the truth, and the unsharded fp32 reference's own distance from it (||ref32 - ref64||
/ ||ref64||, per parameter tensor, and per step's loss) is what fp32 rounding does to this
computation on this CPU. A sharded run sums the same terms in another order (TP and SP
partial sums, DP reduce-scatters), so its rounding is of the same size but not the same:
it must stay within `ROUNDING_FACTOR` times the reference's distance (plus a few fp32
eps for a distance that happens to be near zero). An error of the optimizer itself (a
stale, missing or doubly applied update) moves a parameter by ~lr / |param|, orders above.

The settings (`CFG`) and why they are well conditioned: optim_harness.py.
"""

from __future__ import annotations

import pytest
import torch

from helpers import make_ps
from hfmeg.optim import DistributedOptimizer, OptimizerConfig
from hfmeg.parallel.launch import spawn
from optim_harness import CFG, build_rank_chunk, max_rel_diff, reference, train
from tiny_models import save_tiny

STEPS = 10
# Two fp32 runs that differ only in summation order: their distances from float64 differ by
# about their own size; 8x leaves room for the spread across layouts, CPUs and thread counts.
ROUNDING_FACTOR = 8
FP32_EPS = torch.finfo(torch.float32).eps
LAYOUTS = [dict(tp=1), dict(tp=2, sp=True), dict(tp=1, pp=2), dict(tp=4)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("optim")
    return {"untied": str(save_tiny("llama3", root / "untied")),
            "tied": str(save_tiny("llama3", root / "tied", tie_word_embeddings=True))}


def _distance(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, float]:
    """The worst per-tensor ||ours - ref|| / ||ref|| and max|ours - ref| / max|ref| (as `max_rel_diff`)."""
    diffs = {n: ours[n].double() - ref[n] for n in ref}
    return (max((diffs[n].norm() / ref[n].norm()).item() for n in ref),
            max((diffs[n].abs().max() / ref[n].abs().max()).item() for n in ref))


def _loss_distance(ours: list[float], ref: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(ours, ref))


def _parity(models):
    ps1 = make_ps()  # TP=1 groups for the per-rank single-process reference
    refs = {}
    out = []
    for layout in LAYOUTS:
        ps = make_ps(**layout)
        folder = models["tied" if ps.pp > 1 else "untied"]
        for ga in (1, 4):
            for mode in ("ddp", "distributed", "overlapped"):
                cfg = OptimizerConfig(mode=mode, **CFG)
                if (folder, ga) not in refs:
                    losses32, params32 = reference(folder, cfg, ga, STEPS, ps1)
                    losses64, params64 = reference(folder, cfg, ga, STEPS, ps1, dtype=torch.float64)
                    refs[folder, ga] = (losses64, params64, _loss_distance(losses32, losses64),
                                        _distance(params32, params64))
                ref_losses, ref_params, ref_loss_rel, (ref_rel, ref_rel_max) = refs[folder, ga]
                chunk = build_rank_chunk(folder, ps)
                n_params = sum(p.numel() for p in chunk.parameters())
                opt = DistributedOptimizer([chunk], ps, cfg)
                losses = train(chunk, opt, ps, ga, STEPS)
                opt.wait_params()  # the last step's all-gathers are otherwise waited by the next forward
                rel, rel_max, n = max_rel_diff(chunk, ps, ref_params)
                padded = sum(b.size for b in opt.buckets)
                storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                            for adamw in opt.optimizers.values() for g in adamw.param_groups for p in g["params"]
                            for t in (p, adamw.state[p]["exp_avg"], adamw.state[p]["exp_avg_sq"])}
                out.append(dict(layout=layout, ga=ga, mode=mode, rel=rel, rel_max=rel_max, n=n,
                                loss_rel=_loss_distance(losses, ref_losses), ref_rel=ref_rel, ref_rel_max=ref_rel_max,
                                ref_loss_rel=ref_loss_rel, state_bytes=sum(storages.values()), n_params=n_params,
                                padded=padded, n_buckets=len(opt.buckets), dp=ps.dp, shards=opt.shards))
    return out


def test_matches_adamw_reference_all_layouts_and_modes(models):
    rows = [r for rank in spawn(_parity, 4, models) for r in rank]
    assert len(rows) == 4 * len(LAYOUTS) * 2 * 3
    for r in rows:
        assert r["n"] > 0, r
        assert r["rel"] <= ROUNDING_FACTOR * r["ref_rel"] + 4 * FP32_EPS, r
        # The worst single element, relative to the tensor's largest: a wrong update of a few elements
        # (one bucket shard's edge) shows here when the norm above averages it away.
        assert r["rel_max"] <= ROUNDING_FACTOR * r["ref_rel_max"] + 4 * FP32_EPS, r
        # A step's loss is a float64 sum of DP x GA fp32 partial losses, each rounded once more than the
        # reference's (whose loss rounds to the same fp32 value as float64's at GA 1): 2 eps per term.
        assert r["loss_rel"] <= ROUNDING_FACTOR * r["ref_loss_rel"] + 2 * r["dp"] * r["ga"] * FP32_EPS, r
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
