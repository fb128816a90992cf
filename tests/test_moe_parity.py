"""MoE model parity with transformers: logits, loss with the load-balancing term, every gradient, greedy generation.

Tiny random Mixtral, Qwen2-MoE (a dense layer, a shared expert) and Qwen3-MoE (q/k norms,
norm_topk_prob, a dense layer), one 4-process gloo world per family running TP in {1, 2}
x PP in {1, 2}, SP off and on at TP=2 (the rest of the world as DP replicas), and expert
parallelism inside those replicas: EP 2 and 4 at TP=1, EP 2 at TP=2 with SP. Loss and
gradients come from the pipeline's own `forward_backward`, so the aux term is added where
training adds it, and gradients are finished by the data-parallel wrapper. With PP=2 the aux loss is refused (README, MoE), so those layouts run a
copy of the checkpoint with `output_router_logits` false against transformers without it.
Reference gradients are written by transformers' own `save_pretrained`, so they carry the
per-expert names conversion reads.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from helpers import make_ps
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.checkpoint.rules import chunk_rules, to_hf
from hfmeg.config import load_hf_config, model_config_from_hf
from hfmeg.errors import UnsupportedConfigError
from hfmeg.models.decoder import ModelChunk
from hfmeg.models.generate import full_logits, greedy_generate
from hfmeg.models.moe import MoELayer
from hfmeg.parallel.data_parallel import DataParallel
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.pipeline import forward_backward
from tiny_models import MOE_KINDS, save_tiny

# (tp, pp, sp, ep)
LAYOUTS = [(1, 1, False, 1), (2, 1, False, 1), (2, 1, True, 1), (1, 2, False, 1), (2, 2, False, 1), (2, 2, True, 1),
           (1, 1, False, 2), (1, 1, False, 4), (2, 1, True, 2)]
GENERATE = ((2, 1, False, 1), (1, 1, False, 2))  # layouts that also generate greedily
PROMPT = torch.tensor([[5, 17, 42, 7, 99]])  # odd running lengths: uneven token blocks at TP=2 without SP
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    """{kind: {aux: folder}}: the same weights with the load-balancing loss on and off."""
    root = tmp_path_factory.mktemp("moe")
    return {kind: {aux: save_tiny(kind, root / f"{kind}-{aux}", output_router_logits=aux) for aux in (True, False)}
            for kind in MOE_KINDS}


def _reference(folder, ids, tmp):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    out = model(ids, labels=ids)
    out.loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    model.save_pretrained(tmp)  # gradients under the checkpoint's (per-expert) names
    return out.logits.detach(), out.loss.item(), load_file(tmp / "model.safetensors")


def _gather_tp(t, ps):
    if ps.tp == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(ps.tp)]
    dist.all_gather(parts, t.contiguous(), group=ps.tp_group)
    return parts


def _check_layouts(folders, ids, refs, prompt):
    labels = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], dim=1)
    rows = []
    for tp, pp, sp, ep in LAYOUTS:
        aux = pp == 1
        ref_logits, ref_loss, ref_grads = refs[aux]
        ps = make_ps(tp=tp, pp=pp, sp=sp, ep=ep)
        chunks = load_chunks(HFCheckpoint(folders[aux]), ps)
        logits = full_logits(chunks, ps, ids)
        # The world's DP replicas all take the same rows: a global batch of dp copies, of which this
        # rank's share of the loss is 1/dp; the data-parallel wrapper sums the gradients (over DP, experts'
        # over expert-DP, and the partial ones of the router, experts and q/k norms over TP) as in training.
        wrapper = DataParallel(chunks, ps, "ddp", bucket_size=2**20)
        loss = forward_backward(chunks, ps, [{"input_ids": ids, "labels": labels}], schedule="1f1b",
                                num_tokens=int((labels != -100).sum()) * ps.dp, grad_sync=wrapper)
        loss = loss * ps.dp if loss is not None else None
        wrapper.finish_grad_sync()
        worst, seen = 0.0, set()
        for chunk in chunks:
            params = dict(chunk.named_parameters())
            for rule in chunk_rules(chunk.cfg, chunk.layer_ids, chunk.pre_process, chunk.post_process, chunk.experts):
                for name, g in to_hf(rule, _gather_tp(params[rule.local].main_grad, ps), chunk.cfg).items():
                    ref = ref_grads[name]
                    worst = max(worst, ((g - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item())
                    seen.add(name)
        row = dict(layout=(tp, pp, sp, ep), grad_rel=worst, seen=sorted(seen))
        if logits is not None:
            row.update(logit_diff=(logits - ref_logits).abs().max().item(), loss_diff=abs(loss - ref_loss))
        # The recorded load: every routed token fills top_k expert slots.
        stats = [layer.mlp.stats for c in chunks for layer in c.layers.values() if isinstance(layer.mlp, MoELayer)]
        row["load_ok"] = all(int(st.tokens_per_expert.sum()) == chunks[0].cfg.moe.top_k * st.rows for st in stats)
        if (tp, pp, sp, ep) in GENERATE:
            row["generated"] = greedy_generate(chunks, ps, prompt, NEW_TOKENS).tolist()
        rows.append(row)
    return rows


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_parity(kind, moe_checkpoints, tmp_path):
    folders = moe_checkpoints[kind]
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    refs = {aux: _reference(folders[aux], ids, tmp_path / str(aux)) for aux in (True, False)}
    model = AutoModelForCausalLM.from_pretrained(folders[True], dtype=torch.float32)
    expected = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    results = spawn(_check_layouts, 4, {a: str(f) for a, f in folders.items()}, ids, refs, PROMPT)
    for layout in LAYOUTS:
        rows = [r for rank in results for r in rank if r["layout"] == layout]
        n_ref = len(refs[layout[1] == 1][2])
        assert len({n for r in rows for n in r["seen"]}) == n_ref, layout
        for r in rows:
            assert r["grad_rel"] <= 1e-4 and r["load_ok"], r
            if "logit_diff" in r:
                assert r["logit_diff"] <= 1e-4 and r["loss_diff"] <= 1e-5, r
            if "generated" in r:
                assert r["generated"] == expected.tolist(), (r["generated"], expected)
    assert any("generated" in r for rank in results for r in rank)


def test_aux_loss_with_pp2_is_refused_naming_the_field(moe_checkpoints):
    """Refused where the chunk is built, so every stage stops before any pipeline traffic."""
    cfg = model_config_from_hf(load_hf_config(moe_checkpoints["mixtral"][True]))
    ps = SimpleNamespace(tp=1, tp_rank=0, sequence_parallel=False)  # what construction reads
    with torch.device("meta"), pytest.raises(UnsupportedConfigError, match="^config.json field output_router_logits:"):
        ModelChunk(cfg, ps, [0], pre_process=True, post_process=False)
