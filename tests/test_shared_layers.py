"""Shared layers (issue 16's shared-unlock warm start), at the library level on 2 gloo ranks (DP2; TP2 + SP).

- the shared parameter's gradient is the sum of the per-layer gradients of an unshared
  model holding the same weights in every layer;
- the wrapper's buffers and the optimizer's state hold the layers' part once (1/N);
- shared for k steps, then unlocked through the optimizer state saved by name and
  reloaded with `shared_name`: the logits across the unlock are bit-identical, and the
  run matches a single-process torch AdamW reference that shares layers, then gives each
  layer a clone of the parameters and of their AdamW state (within fp32 rounding of the same reference run
  in float64: `optim_harness.check_within_rounding`).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers import make_ps
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.models.shared_layers import share_layers, shared_name
from hfmeg.optim import DistributedOptimizer, OptimizerConfig, no_weight_decay
from hfmeg.optim.state_io import load_optimizer_state, save_optimizer_state
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.roles import named_roles
from bounds import within
from optim_harness import (CFG, FP32_EPS, ROWS, batch, build_rank_chunk, check_within_rounding, global_tokens,
                           loss_distance, max_rel_diff, train, truth_of)
from tiny_models import save_tiny

LAYERS, SHARED_STEPS, MORE = 3, 3, 3


def _layer_elements(opt, owned: bool) -> int:
    """Elements of decoder-layer parameters in the wrapper's buckets (`owned`: in this rank's optimizer shards)."""
    dp = opt.data_parallel
    if not owned:
        return sum(s.numel for b in opt.buckets for s in b.slots if s.name.startswith("layers."))
    return sum(hi - lo for b in opt.buckets for s, lo, hi in b.segments(dp.shard_rank(b))
               if s.name.startswith("layers."))


def _counts_and_grads(folder):
    ps = make_ps()
    shared = build_rank_chunk(folder, ps)
    share_layers(shared)
    unshared = build_rank_chunk(folder, ps)
    with torch.no_grad():  # the same weights in every layer, each layer its own tensors
        for name, p in unshared.named_parameters():
            p.copy_(dict(shared.named_parameters(remove_duplicate=False))[name])
    out = {}
    for mode in ("overlapped", "ddp"):
        opt_s = DistributedOptimizer([shared], ps, OptimizerConfig(mode=mode, **CFG))
        opt_u = DistributedOptimizer([unshared], ps, OptimizerConfig(mode=mode, **CFG))
        if mode == "overlapped":
            state = torch.tensor([_layer_elements(opt_s, True), _layer_elements(opt_u, True)])
            dist.all_reduce(state)
            out["buffers"] = (_layer_elements(opt_s, False), _layer_elements(opt_u, False))
            out["state"] = tuple(state.tolist())
            out["state_bytes"] = (opt_s.state_bytes(), opt_u.state_bytes())
        else:  # ddp: every rank holds the whole summed gradient
            ntok = global_tokens(0, 1)
            for chunk, opt in ((shared, opt_s), (unshared, opt_u)):
                ids, labels = batch(0, 0)
                rows = slice(ps.dp_rank * ROWS // 2, (ps.dp_rank + 1) * ROWS // 2)
                (chunk(ids[rows], labels=labels[rows]).sum() / ntok).backward()
                opt.data_parallel.finish_grad_sync()
            per_layer = {n: p.main_grad for n, p in unshared.named_parameters()}
            worst, bound = 0.0, float("inf")
            for name, p in shared.named_parameters():
                terms = [per_layer[f"layers.{i}.{name[len('layers.0.'):]}"] for i in range(LAYERS)] \
                    if name.startswith("layers.") else [per_layer[name]]
                want = sum(terms)
                rel = ((p.main_grad - want).norm() / want.norm()).item()
                # Both sides sum the same LAYERS x DP fp32 terms (the layers' weight gradients, each a GEMM's
                # sum over the tokens, then over the DP ranks) in other orders: each sum of n terms rounds by
                # <= (n - 1) eps of the sum of |terms|, per side; with the per-rank GEMMs' own accumulation
                # order (fused into the main grad or not) another such sum. Relative to the result's norm.
                n = LAYERS * ps.dp
                allowed = 2 * (2 * n) * FP32_EPS * (sum(t.abs() for t in terms).norm() / want.norm()).item()
                if rel / allowed > worst / bound:
                    worst, bound = rel, allowed
            out["grad_rel"], out["grad_bound"] = worst, bound
        for opt in (opt_s, opt_u):
            opt.data_parallel.grad_sync.remove_hooks()
    return out


def test_gradients_sum_and_state_is_one_nth(tmp_path):
    folder = str(save_tiny("llama3", tmp_path / "m", num_hidden_layers=LAYERS))
    for out in spawn(_counts_and_grads, 2, folder):
        shared, unshared = out["buffers"]
        assert shared * LAYERS == unshared, out  # the DP buffers hold the layers once
        shared, unshared = out["state"]
        assert shared * LAYERS == unshared, out  # master weights and moments, over both DP ranks
        assert out["state_bytes"][0] < out["state_bytes"][1]
        within(out["grad_rel"], out["grad_bound"], "shared grad == sum of per-layer grads (k eps)", out)


def _unshare(model: nn.Module, opt: torch.optim.AdamW) -> torch.optim.AdamW:
    """The reference's unlock: every layer a clone of the shared parameters and of their AdamW state."""
    layers = list(model.layers.values())
    clones = {}
    for layer in layers[1:]:
        for module in layer.modules():
            for attr, p in list(module.named_parameters(recurse=False)):
                q = nn.Parameter(p.detach().clone())
                setattr(module, attr, q)
                clones[q] = p
    new = _adamw(model)
    for q, p in clones.items():
        new.state[q] = {k: v.clone() for k, v in opt.state[p].items()}
    for p in opt.state:
        new.state[p] = opt.state[p]
    return new


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    cfg = OptimizerConfig(**CFG)
    roles = named_roles(model)
    groups = [{"params": [p for _, p, r in roles if not no_weight_decay(r, cfg)]},
              {"params": [p for _, p, r in roles if no_weight_decay(r, cfg)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay)


def _reference(folder, dtype=torch.float32):
    """Single-process AdamW: shared for SHARED_STEPS, unshared for MORE; per-step losses and the final weights."""
    model = load_chunks(HFCheckpoint(folder), make_ps(world=1), dtype=dtype)[0]
    share_layers(model)
    opt = _adamw(model)
    losses = []
    for step in range(SHARED_STEPS + MORE):
        if step == SHARED_STEPS:
            opt = _unshare(model, opt)
        ids, labels = batch(step, 0)
        loss = model(ids, labels=labels).sum() / global_tokens(step, 1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CFG["grad_clip"])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _shared_then_unlocked(folder, ckpt, tp):
    ps = make_ps(tp=tp, sp=tp > 1)
    cfg = OptimizerConfig(**CFG)
    shared = build_rank_chunk(folder, ps)
    share_layers(shared)
    opt_s = DistributedOptimizer([shared], ps, cfg)
    losses = train(shared, opt_s, ps, 1, SHARED_STEPS)
    save_optimizer_state(opt_s, ckpt)
    opt_s.wait_params()
    unshared = build_rank_chunk(folder, ps)
    with torch.no_grad():
        for name, p in unshared.named_parameters():
            p.copy_(dict(shared.named_parameters(remove_duplicate=False))[name])
    dist.barrier()
    opt_u = DistributedOptimizer([unshared], ps, cfg)
    load_optimizer_state(opt_u, ckpt, shared_name)
    ids, _ = batch(SHARED_STEPS, 0)
    with torch.no_grad():
        same = torch.equal(shared(ids), unshared(ids))
    opt_s.data_parallel.grad_sync.remove_hooks()
    losses += train(unshared, opt_u, ps, 1, MORE, first_step=SHARED_STEPS)
    exact = truth_of(_reference(folder, torch.float64), _reference(folder))
    opt_u.wait_params()
    rel, rel_max, n = max_rel_diff(unshared, ps, exact.params)
    return dict(same=same, rel=rel, rel_max=rel_max, n=n, loss_rel=loss_distance(losses, exact.losses),
                rounding=exact.rounding, dp=ps.dp)


@pytest.mark.parametrize("tp", [1, 2])  # DP2, and TP2 with sequence parallelism
def test_unlock_keeps_logits_and_continues_like_separate_copies(tmp_path, tp):
    folder = str(save_tiny("llama3", tmp_path / "m", num_hidden_layers=LAYERS))
    for r in spawn(_shared_then_unlocked, 2, folder, str(tmp_path / "optim"), tp):
        assert r["same"] and r["n"] > 0, r  # the unlocked model computes exactly what the shared one did
        check_within_rounding(r["rel"], r["rel_max"], r["loss_rel"], r["rounding"], r["dp"], r)
