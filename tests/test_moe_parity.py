"""MoE model parity with transformers: logits, loss with the load-balancing term, every gradient, greedy generation.

Tiny random Mixtral, Qwen2-MoE (a dense layer, a shared expert) and Qwen3-MoE (q/k norms,
norm_topk_prob, a dense layer), one 4-process gloo world per family running TP in {1, 2}
x PP in {1, 2}, SP off and on at TP=2 (the rest of the world as DP replicas), and expert
parallelism inside those replicas: EP 2 and 4 at TP=1, EP 2 at TP=2 with SP and at PP=2.
The load-balancing loss is on everywhere; with PP=2 it spans both stages (the router sums
travel beside the activations; the Qwen models' first stage holds only their dense layer).
Loss and gradients come from the pipeline's own `forward_backward`, so the aux term is
added where training adds it, and gradients are finished by the data-parallel wrapper.
Reference gradients are written by transformers' own `save_pretrained`, so they carry the
per-expert names conversion reads.

Several micro-batches (`test_moe_pipeline_micro_batches`): the aux loss is a mean over
micro-batches, which transformers has no notion of, so a 4-layer Qwen2-MoE (dense layers
0 and 2) runs interleaved PP2 x VPP2 (a first and a middle chunk without MoE layers), an
uneven PP2 split (1F1B, full recompute, a loss scale) and PP2 x TP2 (SP, GPipe) against
one process running hfmeg's pipeline on the same micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from bounds import parity_bounds, within
from helpers import gather_tp, make_ps, next_token_labels, train_step_as_one
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.checkpoint.rules import chunk_rules, to_hf
from hfmeg.data.microbatch import MicroBatch
from hfmeg.models.generate import full_logits, greedy_generate
from hfmeg.models.moe import MoELayer
from hfmeg.parallel.data_parallel import DataParallel
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.pipeline import forward_backward
from hfmeg.parallel.stored_names import stored_tensors
from optim_harness import check_within_rounding, truth_of
from tiny_models import MOE_KINDS, save_tiny

# (tp, pp, sp, ep)
LAYOUTS = [(1, 1, False, 1), (2, 1, False, 1), (2, 1, True, 1), (1, 2, False, 1), (2, 2, False, 1), (2, 2, True, 1),
           (1, 1, False, 2), (1, 1, False, 4), (2, 1, True, 2), (1, 2, False, 2)]
GENERATE = ((2, 1, False, 1), (1, 1, False, 2))  # layouts that also generate greedily
PROMPT = torch.tensor([[5, 17, 42, 7, 99]])  # odd running lengths: uneven token blocks at TP=2 without SP
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    """{kind: folder}, the load-balancing loss on."""
    root = tmp_path_factory.mktemp("moe")
    return {kind: save_tiny(kind, root / kind) for kind in MOE_KINDS}


def _reference(folder, ids, tmp, dtype=torch.float32):
    # transformers' grouped-GEMM experts have no float64 kernel; its eager loop is the same arithmetic
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa",
                                                 experts_implementation="eager").to(dtype)
    out = model(ids, labels=ids)
    out.loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    model.save_pretrained(tmp / str(dtype))  # gradients under the checkpoint's (per-expert) names
    return out.logits.detach(), out.loss.item(), load_file(tmp / str(dtype) / "model.safetensors")


def _references(folder, ids, tmp):
    """transformers' (logits, loss, {name: gradient}) in fp32, and the parity bounds its float64 run gives."""
    ref = _reference(folder, ids, tmp)
    return ref, parity_bounds(ref, _reference(folder, ids, tmp, torch.float64))


def _check_layouts(folder, ids, ref, prompt, layouts=LAYOUTS):
    labels = next_token_labels(ids)
    ref_logits, ref_loss, ref_grads = ref
    rows = []
    for tp, pp, sp, ep in layouts:
        ps = make_ps(tp=tp, pp=pp, sp=sp, ep=ep)
        chunks = load_chunks(HFCheckpoint(folder), ps)
        logits = full_logits(chunks, ps, ids)
        loss, _ = train_step_as_one(chunks, ps, ids, labels)
        worst, seen = _grad_diff(chunks, ps, ref_grads)
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


def _grad_diff(chunks, ps, ref_grads):
    """(worst relative gradient difference, HF names compared) of this rank's finished gradients."""
    worst, seen = 0.0, set()
    for chunk in chunks:
        grads = stored_tensors(chunk, lambda p: p.main_grad)
        for rule in chunk_rules(chunk.cfg, chunk.layer_ids, chunk.pre_process, chunk.post_process, chunk.experts):
            for name, g in to_hf(rule, gather_tp(grads[rule.local], ps), chunk.cfg).items():
                ref = ref_grads[name]
                worst = max(worst, ((g - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item())
                seen.add(name)
    return worst, seen


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_parity(kind, moe_checkpoints, tmp_path):
    folder = moe_checkpoints[kind]
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    ref, bounds = _references(folder, ids, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    expected = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    _assert_parity(spawn(_check_layouts, 4, str(folder), ids, ref, PROMPT), LAYOUTS, ref, bounds, expected)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_parity_eight_and_sixteen_ranks(kind, moe_checkpoints, tmp_path):
    """The rest of TP {1,2} x EP {1,2,4} x PP {1,2}: EP 4 with TP 2 or PP 2 and EP2 x TP2 x PP2 on 8 ranks,
    EP4 x TP2 x PP2 on 16."""
    folder = moe_checkpoints[kind]
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    ref, bounds = _references(folder, ids, tmp_path)
    for world, layouts in ((8, [(2, 1, True, 4), (1, 2, False, 4), (2, 2, True, 2)]), (16, [(2, 2, True, 4)])):
        _assert_parity(spawn(_check_layouts, world, str(folder), ids, ref, PROMPT, layouts), layouts, ref, bounds,
                       None)


def _assert_parity(results, layouts, ref, bounds, expected):
    for layout in layouts:
        rows = [r for rank in results for r in rank if r["layout"] == layout]
        n_ref = len(ref[2])
        assert len({n for r in rows for n in r["seen"]}) == n_ref, layout
        for r in rows:
            assert r["load_ok"], r
            for what in ("grad_rel", "logit_diff", "loss_diff") if "logit_diff" in r else ("grad_rel",):
                within(r[what], bounds[what], what, r)
            if "generated" in r:
                assert r["generated"] == expected.tolist(), (r["generated"], expected)
    assert expected is None or any("generated" in r for rank in results for r in rank)


@dataclass(frozen=True)
class Pipeline:
    pp: int
    schedule: str
    microbatches: int  # per DP rank
    tp: int = 1
    vpp: int = 1
    sp: bool = False
    pp_layers: tuple[int, ...] | None = None  # layers per chunk; default even
    loss_scale: float = 1.0
    recompute: str = "none"


PIPELINES = [Pipeline(2, "interleaved", 2, vpp=2),
             Pipeline(2, "1f1b", 2, pp_layers=(3, 1), loss_scale=4.0, recompute="full"),
             Pipeline(2, "gpipe", 4, tp=2, sp=True)]
MICRO_BATCHES = 4  # the global batch


def _pipelines_truth(folder, mbs):
    """The one-process run of the global batch in float64 (the truth) and fp32 (its distance from the truth is
    what rounding does here), computed once in the test process for every rank."""
    one = make_ps(world=1)
    num_tokens = sum(m.label_tokens() for m in mbs)

    def reference(dtype):
        chunk = load_chunks(HFCheckpoint(folder), one, dtype=dtype)[0]
        loss = forward_backward([chunk], one, mbs, schedule="1f1b", num_tokens=num_tokens)
        grads = stored_tensors(chunk, lambda p: p.grad)
        return [loss], {name: g for rule in chunk_rules(chunk.cfg, chunk.layer_ids, True, True, chunk.experts)
                        for name, g in to_hf(rule, [grads[rule.local]], chunk.cfg).items()}

    return truth_of(reference(torch.float64), reference(torch.float32))


def _pipelines(folder, mbs, exact):
    num_tokens = sum(m.label_tokens() for m in mbs)
    (ref_loss,), ref_grads = exact.losses, exact.params
    rows = []
    for case in PIPELINES:
        ps = make_ps(tp=case.tp, pp=case.pp, vpp=case.vpp, sp=case.sp)
        pp_layers = list(case.pp_layers) if case.pp_layers else None
        chunks = load_chunks(HFCheckpoint(folder), ps, pp_layers=pp_layers, recompute=case.recompute)
        wrapper = DataParallel(chunks, ps, "ddp", bucket_size=2**20)
        m = case.microbatches
        mine = mbs[ps.dp_rank * m:(ps.dp_rank + 1) * m]
        run = dict(schedule=case.schedule, num_tokens=num_tokens)
        loss = forward_backward(chunks, ps, mine, grad_sync=wrapper, loss_scale=case.loss_scale, **run)
        wrapper.finish_grad_sync()
        again = forward_backward(chunks, ps, mine, forward_only=True, **run)
        for chunk in chunks:
            for p in chunk.parameters():
                p.main_grad /= case.loss_scale
        worst, seen = _grad_diff(chunks, ps, ref_grads)
        row = dict(layout=case, grad_rel=worst, seen=seen, rounding=exact.rounding)
        if loss is not None:
            total = torch.tensor([loss, again])
            dist.all_reduce(total, group=ps.dp_group)
            row["loss_rel"] = ((total - ref_loss).abs().max() / abs(ref_loss)).item()
        rows.append(row)
    return rows, len(ref_grads)


def test_moe_pipeline_micro_batches(tmp_path):
    """The aux loss's mean over micro-batches across stages: loss (and forward_only's) and every gradient."""
    folder = save_tiny("qwen2_moe", tmp_path / "qwen4", num_hidden_layers=4, layer_types=["full_attention"] * 4)
    g = torch.Generator().manual_seed(1)
    mbs = [MicroBatch(input_ids=ids, labels=next_token_labels(ids))
           for ids in torch.randint(0, 300, (MICRO_BATCHES, 2, 16), generator=g)]
    results = spawn(_pipelines, 4, str(folder), mbs, _pipelines_truth(str(folder), mbs))
    n_ref = results[0][1]
    for i, layout in enumerate(PIPELINES):
        rows = [rank[0][i] for rank in results]
        assert len(set().union(*(r["seen"] for r in rows))) == n_ref, layout
        for r in rows:
            # grad_rel is max|ours - fp64| / max|fp64| per tensor, as Rounding.rel_max; the loss sums 4 micro-batches.
            check_within_rounding(None, r["grad_rel"], r.get("loss_rel"), r["rounding"], MICRO_BATCHES, r)
        assert any("loss_rel" in r for r in rows), layout
