"""DeepSeek-V3 (`hfmeg/families/deepseek_v3.py`): its config reader and refusals, HF -> shards -> HF bit-exact, and
logits and every gradient against transformers (fp32) on rows packed with several documents.

The tiny checkpoint (`tests/tiny_models.py`) has MLA with a query latent, interleaved RoPE and YaRN's two mscales.
Parity runs in one 4-process gloo world at TP {1, 2} (SP on and off) x EP {1, 2}, PP 2 and CP 2 (with EP 2, with
TP 2 + SP; gradients only), selective recompute at TP2 + SP and full at EP2, the gradients finished by the
data-parallel wrapper as in training; the reference is transformers run on each document alone. TP2 also generates
greedily, as transformers' `generate` does.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from bounds import parity_bounds, within
from convert_helpers import assert_same_tensors
from helpers import gather_tp, make_ps, stories_or_skip
from hfmeg.checkpoint.convert import hf_to_mp, mp_to_hf
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.checkpoint.mp_layout import iteration_dir_name
from hfmeg.checkpoint.mp_reader import MPCheckpoint
from hfmeg.checkpoint.mp_save import chunks_layout, staged_save, write_model_shard
from hfmeg.checkpoint.rules import chunk_rules, to_hf
from hfmeg.errors import UnsupportedConfigError
from hfmeg.data import DataConfig, SourceConfig
from hfmeg.data.microbatch import MicroBatch
from hfmeg.families import model_config_from_hf
from hfmeg.models.generate import full_logits, greedy_generate
from hfmeg.parallel.data_parallel import DataParallel
from hfmeg.optim import DistributedOptimizer, OptimizerConfig, no_weight_decay
from hfmeg.optim.state_io import load_optimizer_state, save_optimizer_state
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.roles import named_roles
from hfmeg.parallel.pipeline import forward_backward
from hfmeg.parallel.stored_names import stored_tensors
from hfmeg.peft.adapters import check_model
from hfmeg.peft.config import PeftConfig
from hfmeg.plan.cli import main as plan_main
from hfmeg.optim.lr_schedule import LRScheduleConfig
from hfmeg.plan.flops import training_flops
from hfmeg.train.config import CheckpointArgs, LoopArgs, ModelArgs, ParallelArgs, TrainConfig
from hfmeg.train.trainer import Trainer
from hfmeg.models.routing import sigmoid_grouped_topk
from optim_harness import CFG, batch, build_rank_chunk, global_tokens, train
from tiny_models import ASSETS, save_tiny, tiny_config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

DENSE = dict(first_k_dense_replace=3)  # every layer dense
DOCS = (7, 9)  # one packed row of two documents
# (tp, pp, sp, ep, cp) in one 4-process world, the rest of it DP replicas (EP inside them)
LAYOUTS = [(1, 1, False, 1, 1), (2, 1, False, 1, 1), (2, 1, True, 1, 1), (1, 2, False, 1, 1), (1, 1, False, 2, 1),
           (2, 1, True, 2, 1), (1, 1, False, 1, 2), (1, 1, False, 2, 2), (2, 1, True, 1, 2)]
RECOMPUTE = {(2, 1, True, 1, 1): "selective", (1, 1, False, 2, 1): "full"}  # the others: none
GENERATE = (2, 1, False, 1, 1)  # also generates greedily, against transformers' generate
PROMPT, NEW_TOKENS = torch.tensor([[5, 17, 42, 7, 99]]), 6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v3")
    return {"moe": save_tiny("deepseek_v3", root / "moe"),
            "dense": save_tiny("deepseek_v3", root / "dense", **DENSE),
            "dense_no_q_latent": save_tiny("deepseek_v3", root / "dense_q", q_lora_rank=None, rope_interleave=False,
                                           **DENSE)}


def test_config_reads_mla():
    cfg = model_config_from_hf(tiny_config("deepseek_v3", **DENSE))
    m = cfg.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (16, 12, 8, 4, 6)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rotary_dim, m.rope_interleave) == (12, 4, 4, True)
    # YaRN: qk_head_dim^-0.5 x (0.1 mscale_all_dim ln(factor) + 1)^2
    assert cfg.attn_scale(0) == pytest.approx(12 ** -0.5 * (0.1 * math.log(4.0) + 1) ** 2, rel=1e-12)
    assert cfg.to_dict()["mla"]["v_head_dim"] == 6
    # attention (per layer): q_a, its norm, q_b; kv_a, its norm, kv_b; o
    attn = 32 * 16 + 16 + 16 * 4 * 12 + 32 * 16 + 12 + 12 * 4 * 14 + 4 * 6 * 32
    assert cfg.num_params() == 3 * (attn + 3 * 32 * 48 + 2 * 32) + 2 * 300 * 32 + 32


def test_config_reads_the_routing():
    m = model_config_from_hf(tiny_config("deepseek_v3")).moe
    assert (m.num_experts, m.top_k, m.expert_ffn_size, m.sparse_layers, m.shared_expert_ffn_size) == (4, 2, 16, [1, 2], 16)
    assert (m.scoring, m.n_group, m.topk_group, m.routed_scaling_factor) == ("sigmoid", 2, 1, 2.5)
    assert m.score_correction_bias and m.combine_fp32 and not m.shared_expert_gate and not m.output_router_logits
    assert model_config_from_hf(tiny_config("deepseek_v3", **DENSE)).moe is None


@pytest.mark.parametrize("field, value", [("attention_bias", True), ("num_key_value_heads", 2), ("n_group", 4),
                                          ("n_group", 3), ("n_group", None), ("topk_group", 3),
                                          ("num_experts_per_tok", 3), ("qk_rope_head_dim", 3)])
def test_unbuilt_fields_are_refused_naming_the_field(field, value):
    with pytest.raises(UnsupportedConfigError, match=f"^config.json field {field}:"):
        model_config_from_hf(tiny_config("deepseek_v3", **{field: value}))


def test_router_matches_transformers():
    """Grouped sigmoid top-k with a correction bias large enough to change choices: the same experts and weights as
    transformers' DeepseekV3TopkRouter, to the bit."""
    hf = tiny_config("deepseek_v3", n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3)
    router = DeepseekV3TopkRouter(hf)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        router.e_score_correction_bias.normal_(0, 0.5)
    x = torch.randn(64, hf.hidden_size)
    _, ref_w, ref_idx = router(x)
    unbiased = sigmoid_grouped_topk(x @ router.weight.t(), None, model_config_from_hf(hf).moe)[1]
    w, idx, _ = sigmoid_grouped_topk(x @ router.weight.t(), router.e_score_correction_bias, model_config_from_hf(hf).moe)
    order, ref_order = idx.argsort(dim=-1), ref_idx.argsort(dim=-1)
    assert torch.equal(idx.gather(1, order), ref_idx.gather(1, ref_order))
    assert torch.equal(w.gather(1, order), ref_w.gather(1, ref_order))
    assert not torch.equal(unbiased.sort(dim=-1)[0], idx.sort(dim=-1)[0])  # the bias changed some choices


@pytest.mark.parametrize("kind", ["moe", "dense", "dense_no_q_latent"])
def test_round_trip_bit_exact(kind, checkpoints, tmp_path):
    for tp, pp in ((2, 2), (2, 1)):
        mp, out = tmp_path / f"mp{tp}{pp}", tmp_path / f"hf{tp}{pp}"
        hf_to_mp(checkpoints[kind], mp, tp=tp, pp=pp)
        mp_to_hf(mp, out)
        assert assert_same_tensors(checkpoints[kind], out) > 0


def test_mtp_layers_are_carried_verbatim(tmp_path):
    """A checkpoint with an MTP layer (`model.layers.3.*` of a 3-layer model, as DeepSeek-V3's 61st): converted at
    TP2 x PP2 and exported, every tensor comes back byte for byte, the MTP ones untrained beside the others."""
    src = save_tiny("deepseek_v3", tmp_path / "src")
    tensors = load_file(src / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    mtp = {"model.layers.3.eh_proj.weight": torch.randn(32, 64, generator=g),
           "model.layers.3.enorm.weight": torch.randn(32, generator=g).to(torch.bfloat16)}
    save_file({**tensors, **mtp}, src / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    hf_to_mp(src, tmp_path / "mp", tp=2, pp=2)
    mp_to_hf(tmp_path / "mp", tmp_path / "hf")
    assert assert_same_tensors(src, tmp_path / "hf") == len(tensors) + 2


def _save_at_ep2(src: str, out: str) -> None:
    """Load at TP2 x EP2 (4 ranks), save the shards as the trainer does, export them from rank 0."""
    ps = make_ps(tp=2, ep=2)
    chunks = load_chunks(HFCheckpoint(src), ps)
    with staged_save(chunks_layout(chunks, ps, 0), ps, Path(out) / "mp", src) as folder:
        write_model_shard(chunks, ps, chunks_layout(chunks, ps, 0), folder)
    if dist.get_rank() == 0:
        mp_to_hf(Path(out) / "mp" / iteration_dir_name(0), Path(out) / "hf")


def test_round_trip_bit_exact_at_ep2(checkpoints, tmp_path):
    spawn(_save_at_ep2, 4, str(checkpoints["moe"]), str(tmp_path))
    assert assert_same_tensors(checkpoints["moe"], tmp_path / "hf") > 0


def _packed():
    """ids, position ids, segment ids, labels `[1, s]` of one row packing `DOCS` (no label across a document's end)."""
    ids = torch.randint(0, 300, (1, sum(DOCS)), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0)
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(DOCS)]).unsqueeze(0)
    labels = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in ids[0].split(DOCS)]).unsqueeze(0)
    return ids, pos, seg, labels


def _reference(folder, tmp, dtype=torch.float32):
    """transformers on each document alone: logits `[1, s, V]` and the gradients of the mean loss over the row's
    labels, under the checkpoint's (per-expert) names: written by `save_pretrained` (the correction bias left out)."""
    # transformers' grouped-GEMM experts have no float64 kernel; its eager loop is the same arithmetic
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa",
                                                 experts_implementation="eager").to(dtype)
    ids, _, _, labels = _packed()
    logits = torch.cat([model(d.unsqueeze(0)).logits for d in ids[0].split(DOCS)], dim=1)
    loss = torch.nn.functional.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="sum")
    (loss / (labels != -100).sum()).backward()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    model.save_pretrained(Path(tmp) / str(dtype))
    grads = {n: g for n, g in load_file(Path(tmp) / str(dtype) / "model.safetensors").items()
             if "e_score_correction_bias" not in n}
    return logits.detach(), grads


def _check_layouts(folder, layouts, ref):
    ref_logits, ref_grads = ref
    ids, pos, seg, labels = _packed()
    report = []
    for tp, pp, sp, ep, cp in layouts:
        ps = make_ps(tp=tp, pp=pp, sp=sp, ep=ep, cp=cp)
        chunks = load_chunks(HFCheckpoint(folder), ps, recompute=RECOMPUTE.get((tp, pp, sp, ep, cp), "none"))
        logits = full_logits(chunks, ps, ids, pos, seg) if cp == 1 else None
        # Every DP replica takes the same row, so this rank's share of the loss is 1/dp; the data-parallel wrapper
        # sums the gradients as training does (experts' over expert-DP, partial ones over TP and CP).
        wrapper = DataParallel(chunks, ps, "ddp", bucket_size=2**20)
        mb = MicroBatch(input_ids=ids, labels=labels, position_ids=pos, segment_ids=seg).shard(ps.cp_rank, cp)
        forward_backward(chunks, ps, [mb], schedule="1f1b", num_tokens=int((labels != -100).sum()) * ps.dp,
                         grad_sync=wrapper)
        wrapper.finish_grad_sync()
        worst, seen = 0.0, set()
        for chunk in chunks:
            grads = stored_tensors(chunk, lambda p: p.main_grad if p.requires_grad else None)
            for rule in chunk_rules(chunk.cfg, chunk.layer_ids, chunk.pre_process, chunk.post_process, chunk.experts):
                if grads[rule.local] is None:  # the correction bias: not trained
                    continue
                for name, g in to_hf(rule, gather_tp(grads[rule.local], ps), chunk.cfg).items():
                    ref = ref_grads[name]
                    worst = max(worst, ((g - ref).abs().max() / ref.abs().max()).item())
                    seen.add(name)
        row = dict(layout=(tp, pp, sp, ep, cp), grad_rel=worst, seen=sorted(seen))
        if (tp, pp, sp, ep, cp) == GENERATE:
            row["generated"] = greedy_generate(chunks, ps, PROMPT, NEW_TOKENS).tolist()
        if logits is not None:
            row["logit_diff"] = (logits - ref_logits).abs().max().item()
        report.append(row)
    return report


@pytest.mark.parametrize("kind", ["dense", "dense_no_q_latent", "moe"])
def test_parity_with_transformers_on_packed_rows(kind, checkpoints, tmp_path):
    folder = checkpoints[kind]
    layouts = LAYOUTS if kind == "moe" else [layout for layout in LAYOUTS if layout[3] == 1]
    ref = _reference(folder, tmp_path)
    logits64, grads64 = _reference(folder, tmp_path, torch.float64)
    bounds = parity_bounds((ref[0], 0.0, ref[1]), (logits64, 0.0, grads64))  # no loss compared here
    n_ref = len(ref[1])
    results = [row for rank in spawn(_check_layouts, 4, str(folder), layouts, ref) for row in rank]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    expected = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False).tolist()
    generated = [r["generated"] for r in results if "generated" in r]
    assert generated and all(g == expected for g in generated), (generated, expected)
    for layout in layouts:
        rows = [r for r in results if r["layout"] == layout]
        assert len({n for r in rows for n in r["seen"]}) == n_ref, layout
        assert layout[4] > 1 or any("logit_diff" in r for r in rows), layout
        for r in rows:
            within(r["grad_rel"], bounds["grad_rel"], "grad_rel", r)
            if "logit_diff" in r:
                within(r["logit_diff"], bounds["logit_diff"], "logit_diff", r)


# Aux-loss-free balancing: 4-rank runs (TP2 with SP, EP2 over DP2, 2 micro-batches a step; the overlapped optimizer
# with full recompute, and the distributed one saved and resumed halfway) against a plain single-process loop that
# counts each forward's routing and applies the rule by hand.
BIAS_STEPS, BIAS_GA, RATE = 10, 2, 1e-3
ALPACA = ASSETS / "data" / "alpaca_en_demo.json"


def _biases(chunk) -> dict[int, torch.Tensor]:
    return {int(i): layer.mlp.score_bias.bias.detach().clone() for i, layer in chunk.layers.items()
            if hasattr(layer.mlp, "score_bias")}


def _trained_biases(folder, out):
    ps = make_ps(tp=2, sp=True, ep=2)
    # Uninterrupted: the overlapped optimizer, with full recompute.
    chunk = build_rank_chunk(folder, ps, recompute="full")
    opt = DistributedOptimizer([chunk], ps, OptimizerConfig(mode="overlapped", router_bias_update_rate=RATE, **CFG))
    train(chunk, opt, ps, BIAS_GA, BIAS_STEPS)
    uninterrupted = _biases(chunk)
    opt.data_parallel.grad_sync.remove_hooks()
    # The distributed optimizer for half the steps, saved as the trainer saves, resumed from the shards.
    cfg = OptimizerConfig(mode="distributed", router_bias_update_rate=RATE, **CFG)
    chunk = build_rank_chunk(folder, ps)
    opt = DistributedOptimizer([chunk], ps, cfg)
    half = BIAS_STEPS // 2
    train(chunk, opt, ps, BIAS_GA, half)
    layout = chunks_layout([chunk], ps, half)
    with staged_save(layout, ps, Path(out), folder) as saved:
        write_model_shard([chunk], ps, layout, saved)
        save_optimizer_state(opt, saved / "optim")
    opt.data_parallel.grad_sync.remove_hooks()
    source = MPCheckpoint(Path(out) / iteration_dir_name(half))
    chunk = load_chunks(source, ps)[0]
    opt = DistributedOptimizer([chunk], ps, cfg)
    load_optimizer_state(opt, source.folder / "optim")
    train(chunk, opt, ps, BIAS_GA, half, first_step=half)
    return uninterrupted, _biases(chunk)


def _reference_biases(folder):
    """Plain AdamW on one process over the whole global batch; after each step, bias += u * sign(mean - load) with
    the load summed over the step's micro-batches."""
    cfg = OptimizerConfig(**CFG)
    model = build_rank_chunk(folder, make_ps(world=1))
    roles = named_roles(model)
    opt = torch.optim.AdamW([{"params": [p for _, p, r in roles if not no_weight_decay(r, cfg)]},
                             {"params": [p for _, p, r in roles if no_weight_decay(r, cfg)], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    moe = {int(i): layer.mlp for i, layer in model.layers.items() if hasattr(layer.mlp, "score_bias")}
    for step in range(BIAS_STEPS):
        ntok = global_tokens(step, BIAS_GA)
        loads = {i: 0 for i in moe}
        for m in range(BIAS_GA):
            ids, labels = batch(step, m)
            (model(ids, labels=labels).sum() / ntok).backward()
            for i, layer in moe.items():
                loads[i] = loads[i] + layer.stats.tokens_per_expert
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for i, layer in moe.items():
                load = loads[i].float()
                layer.score_bias.bias += RATE * torch.sign(load.mean() - load)
    return _biases(model)


def test_correction_bias_update_matches_the_rule_and_resumes_exactly(checkpoints, tmp_path):
    folder = checkpoints["moe"]
    start = _biases(load_chunks(HFCheckpoint(folder), make_ps(world=1))[0])
    ref = _reference_biases(folder)
    assert all((ref[i] - start[i]).abs().max() > RATE / 2 for i in ref), "the biases did not move"
    for uninterrupted, resumed in spawn(_trained_biases, 4, str(folder), str(tmp_path)):
        assert sorted(uninterrupted) == sorted(ref) == [1, 2]
        for i in ref:
            assert torch.equal(uninterrupted[i], ref[i]), (i, uninterrupted[i], ref[i])
            assert torch.equal(resumed[i], ref[i]), (i, resumed[i], ref[i])


def _steps_without_updates(folder):
    ps = make_ps()
    chunk = build_rank_chunk(folder, ps)
    start = _biases(chunk)
    opt = DistributedOptimizer([chunk], ps, OptimizerConfig(mode="ddp", router_bias_update_rate=0.0, **CFG))
    train(chunk, opt, ps, 1, 2)
    return start, _biases(chunk)


def test_correction_bias_stays_without_updates(checkpoints):
    """`router_bias_update_rate` 0: the biases stay as loaded, whatever the steps route."""
    start, after = spawn(_steps_without_updates, 1, str(checkpoints["moe"]))[0]
    assert sorted(after) == [1, 2] and all(torch.equal(b, start[i]) for i, b in after.items())


def test_training_flops_count_latent_attention_and_active_experts():
    cfg = model_config_from_hf(tiny_config("deepseek_v3"))
    h, H, s = 32, 4, 16
    attention = h * 16 + 16 * H * 12 + h * (12 + 4) + 12 * H * (8 + 6) + H * 6 * h  # the five projections
    dense = 3 * h * 48
    sparse = h * 4 + 2 * 3 * h * 16 + 3 * h * 16  # router, top-2 experts, the ungated shared expert
    matmuls = 3 * attention + dense + 2 * sparse + h * 300
    scores_values = 3 * s * H * (12 + 6)  # per token: s keys, the score and value products' widths
    assert training_flops(cfg, 1, s) == 6 * s * matmuls + 2 * 3 * s * scores_values


def test_step_time_moves_the_latents_over_tp():
    """Under TP + SP, MLA all-gathers its latents forward and reduce-scatters their gradients backward where a layer
    moves its hidden state: 100 more kv-latent columns cost each of the 3 layers two ring passes of 100 e-byte
    columns per token, over the TP link, and nothing else the TP link carries."""
    from hfmeg.plan.hardware import ClusterSpec, gpu_spec
    from hfmeg.plan.layout import PlanLayout
    from hfmeg.plan.profile import default_profile
    from hfmeg.plan.step_time import step_time

    gpu = gpu_spec("h100")
    cluster, prof = ClusterSpec(gpu, 2), default_profile("h100", gpu.peak_flops, gpu.hbm_bytes_per_s)
    dense = model_config_from_hf(tiny_config("deepseek_v3", **DENSE))
    wide = replace(dense, mla=replace(dense.mla, kv_lora_rank=dense.mla.kv_lora_rank + 100))
    seq, e = 64, 2
    comm = [step_time(cfg, PlanLayout(2, 1, 1, 1), cluster, prof, 1, seq, e).tp_comm_s for cfg in (dense, wide)]
    bandwidth = cluster.link(2, 1, crosses=False)[0] * prof.link_efficiency  # TP inside the node
    expected = 3 * 2 * (1 / 2) * e * seq * 100 / bandwidth * prof.sequence_parallel_comm
    assert comm[1] - comm[0] == pytest.approx(expected, rel=1e-9)


def test_the_planner_plans_latent_attention_with_expert_parallelism(checkpoints, capsys):
    """`hfmeg plan` searches DeepSeek-V3's layouts (EP among them) and evaluates one; its memory is checked against
    the meter in test_plan_memory.py."""
    args = ["--model", str(checkpoints["moe"]), "--gpu", "h100", "--gpus", "8", "--global-batch-size", "8",
            "--seq-len", "128", "--json"]
    assert plan_main(args) == 0
    best = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert best["memory_bytes_per_gpu"] > 0 and best["step_s"] > 0, best
    assert plan_main(args + ["--tp", "2", "--ep", "2", "--recompute", "selective"]) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert one["layout"] == "tp2sp-pp1-dp4-ep2-mb1-selective-overlapped" and one["step_s"] > 0, one


@pytest.mark.parametrize("overrides, peft, field", [
    ({}, dict(method="dora", target_modules=["q_a_proj"]), "method"),
    ({}, dict(dropout=0.1, target_modules=["kv_a_proj_with_mqa"]), "dropout"),
    ({}, dict(target_modules=["q_proj"]), "target_modules"),
    ({"q_lora_rank": None}, dict(target_modules=["q_b_proj"]), "target_modules")])
def test_lora_refusals_name_the_field(overrides, peft, field):
    with pytest.raises(UnsupportedConfigError, match=f"^peft.{field}"):
        check_model(model_config_from_hf(tiny_config("deepseek_v3", **overrides)), PeftConfig(**{"method": "lora", **peft}))


def _counted_loads(folder):
    """(top_k x tokens routed, the load counted) per MoE layer: one training forward and backward under full
    recompute (whose repeated forward must not count again), after a forward without gradients (not counted)."""
    ps = make_ps()
    chunk = build_rank_chunk(folder, ps, recompute="full")
    ids, labels = batch(0, 0)
    with torch.no_grad():
        chunk(ids, labels=labels)
    chunk(ids, labels=labels).sum().backward()
    k = chunk.cfg.moe.top_k
    return [(k * layer.mlp.stats.rows, int(layer.mlp.score_bias.load.sum())) for layer in chunk.layers.values()
            if hasattr(layer.mlp, "score_bias")]


def test_the_load_counts_each_training_forward_once(checkpoints):
    counted = spawn(_counted_loads, 1, str(checkpoints["moe"]))[0]
    assert len(counted) == 2 and all(want == got > 0 for want, got in counted), counted


def test_the_trainer_runs_and_exports_a_model_transformers_loads(tmp_path):
    """3 steps of the trainer at EP2 x TP2 (SP) on 4 ranks: the exported folder loads with transformers, its
    correction biases moved by whole multiples of the rate (at most one per step) and its other tensors trained."""
    stories = stories_or_skip()
    if not ALPACA.is_file():
        pytest.skip(f"{ALPACA} is absent")
    model = save_tiny("deepseek_v3", tmp_path / "ds", vocab_size=512)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(stories / name, model / name)
    steps = 3
    cfg = TrainConfig(model=ModelArgs(path=str(model), dtype="fp32"),
                      parallel=ParallelArgs(tp=2, ep=2, sequence_parallel=True),
                      optim=OptimizerConfig(lr=1e-3, eps=1e-5, router_bias_update_rate=RATE),
                      lr=LRScheduleConfig(warmup_steps=1, total_steps=steps),
                      data=DataConfig(sources=[SourceConfig(str(ALPACA))], seq_len=64),
                      train=LoopArgs(micro_batch_size=1, global_batch_size=4, max_steps=steps, eval_every=0),
                      checkpoint=CheckpointArgs(out=str(tmp_path / "run"), save_every=0, keep_last=1),
                      report_to=[])
    exported = spawn(_train_run, 4, cfg)[0]
    before, after = HFCheckpoint(model), HFCheckpoint(exported)
    AutoModelForCausalLM.from_pretrained(exported)
    for i in (1, 2):
        name = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
        moves = (after.get(name) - before.get(name)) / RATE
        assert moves.abs().max() > 0.5 and moves.abs().max() <= steps + 1e-3, moves
        assert torch.allclose(moves, moves.round(), atol=1e-3), moves
    assert not torch.equal(after.get("model.layers.1.self_attn.kv_b_proj.weight"),
                           before.get("model.layers.1.self_attn.kv_b_proj.weight"))


def _train_run(cfg):
    return str(Trainer(cfg).run().hf_folder)
