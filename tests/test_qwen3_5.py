"""Qwen3.5 text (`qwen3_5_text`) and Qwen3.5-MoE text (`qwen3_5_moe_text`): conversion round trips, and parity
with transformers on packed rows.

The tiny checkpoints (tests/tiny_models.py) have three Gated DeltaNet layers and one gated full-attention layer (the
MoE one: 4 experts, top 2, a gated shared expert in every layer; its load-balancing loss off here, as transformers'
is a product of means over the tokens of one forward, which a document-by-document reference cannot give).
transformers has no packing (its linear-attention layers would carry their state across documents), so each
document of a packed row runs through it alone; the rows are longer than the delta rule's 64-token chunk, with
documents starting inside chunks and crossing chunk boundaries.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from bounds import parity_bounds, spread_bound, within
from convert_helpers import assert_same_tensors
from helpers import gather_tp, make_ps
from hfmeg.checkpoint.convert import hf_to_mp, mp_to_hf
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.checkpoint.rules import chunk_rules, to_hf
from hfmeg.config import check_cp
from hfmeg.errors import UnsupportedConfigError
from hfmeg.families import model_config_from_hf
from hfmeg.models.generate import full_logits, greedy_generate
from hfmeg.parallel.comm import sync_sequence_parallel_grads
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.stored_names import stored_tensors
from tiny_models import save_tiny, tiny_config

DOCS = (30, 45, 25)  # a 100-token row: documents start inside the first and second 64-token chunks
LOGIT_LAYOUTS = [(1, 1, False, 1), (2, 1, False, 1), (2, 1, True, 1), (1, 2, False, 1), (2, 2, True, 1)]  # tp pp sp ep
EP_LAYOUTS = [(1, 1, False, 2), (2, 1, True, 2)]  # the MoE model's logits with its experts over 2 EP ranks
KINDS = ("qwen3_5", "qwen3_5_moe")
GRAD_LAYOUTS = [(1, False), (2, False), (2, True)]  # (tp, sp)
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5")
    return {"qwen3_5": save_tiny("qwen3_5", root / "dense"),
            "qwen3_5_moe": save_tiny("qwen3_5_moe", root / "moe", output_router_logits=False)}


def _logit_layouts(folder) -> list[tuple[int, int, bool, int]]:
    return LOGIT_LAYOUTS + (EP_LAYOUTS if "moe" in str(folder) else [])


def _packed():
    """ids, positions, segment ids and next-token labels (none across a document's end) of two packed rows."""
    ids = torch.randint(0, 300, (2, sum(DOCS)), generator=torch.Generator().manual_seed(3))
    seg = torch.repeat_interleave(torch.arange(1, len(DOCS) + 1), torch.tensor(DOCS)).expand(2, -1).contiguous()
    pos = torch.cat([torch.arange(n) for n in DOCS]).expand(2, -1).contiguous()
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    labels[:, :-1][seg[:, 1:] != seg[:, :-1]] = -100
    return ids, pos, seg, labels


def _reference(folder):
    """transformers on each document alone: the logits, and every gradient of the rows' mean token loss."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids, _, _, labels = _packed()
    count = (labels != -100).sum()
    logits, start = [], 0
    for n in DOCS:
        out = model(ids[:, start:start + n]).logits
        F.cross_entropy(out.flatten(0, 1), labels[:, start:start + n].flatten(), reduction="sum").div(count).backward()
        logits.append(out.detach())
        start += n
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    grads = Path(folder).with_name(Path(folder).name + "_grads")
    model.save_pretrained(grads)  # the gradients under the checkpoint's names (experts one by one)
    return torch.cat(logits, dim=1), load_file(grads / "model.safetensors")


def _sharded(folder):
    """This rank's logits, greedy ids and gradients. Every DP rank takes the same rows and no collective spans DP
    here, so a layout's copies beyond its first EP group (DP ranks >= EP: the EP groups are consecutive DP ranks)
    would compute that group's results again exactly: they only create the layout's groups, as every rank must."""
    ids, pos, seg, labels = _packed()
    out = {}
    for layout in _logit_layouts(folder):
        tp, pp, sp, ep = layout
        ps = make_ps(tp=tp, pp=pp, sp=sp, ep=ep)
        if ps.dp_rank >= ep:
            continue
        logits = full_logits(load_chunks(HFCheckpoint(folder), ps), ps, ids, pos, seg)
        if logits is not None:
            out[("logits", *layout)] = logits
    ps = make_ps(tp=2, pp=2)
    out["generated"] = greedy_generate(load_chunks(HFCheckpoint(folder), ps), ps, ids[:1, :12], NEW_TOKENS)
    for tp, sp in GRAD_LAYOUTS:
        ps = make_ps(tp=tp, sp=sp)
        if ps.dp_rank == 0:
            out[("grads", tp, sp)] = _grads(folder, ps)
    return out


def _grads(folder, ps, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """hfmeg's gradients of the packed rows' mean token loss in the layout `ps`, under the checkpoint's names."""
    ids, pos, seg, labels = _packed()
    chunk = load_chunks(HFCheckpoint(folder), ps, dtype=dtype)[0]
    losses = chunk(ids, labels=labels, position_ids=pos, segment_ids=seg)
    (losses.sum() / (labels != -100).sum()).backward()
    sync_sequence_parallel_grads([chunk], ps)
    params = stored_tensors(chunk, lambda p: p.grad)  # the stacked experts' gradients by expert
    grads = {}
    for rule in chunk_rules(chunk.cfg, chunk.layer_ids, True, True):
        grads.update(to_hf(rule, gather_tp(params[rule.local], ps), chunk.cfg))
    return grads


def _bounds(folder, ref_logits, ref_grads):
    """Bounds from the arithmetic (bounds.spread_bound): hfmeg's one-process run in float64 is the truth (transformers'
    torch forms of the delta rule compute in fp32 whatever the model's dtype, so its own float64 run is not), and a
    layout and transformers (fp32) are each as far from it as rounding puts hfmeg's one-process fp32 run and
    transformers' run: (logits bound, {name: gradient bound relative to the tensor's largest})."""
    ids, pos, seg, _ = _packed()
    one = make_ps(world=1)
    logits = {dtype: full_logits(load_chunks(HFCheckpoint(folder), one, dtype=dtype), one, ids, pos, seg)
              for dtype in (torch.float32, torch.float64)}
    ours, exact = _grads(folder, one), _grads(folder, one, torch.float64)
    return (spread_bound([logits[torch.float32], ref_logits], logits[torch.float64]),
            {n: spread_bound([ours[n], ref_grads[n]], g, relative=True) for n, g in exact.items()})


@pytest.mark.parametrize("kind", KINDS)
def test_packed_rows_match_transformers_tp_sp_pp(tiny, kind):
    """Logits at TP ∈ {1, 2} × PP ∈ {1, 2} (SP on and off; the MoE model also at EP 2) and every gradient at
    TP ∈ {1, 2} against transformers run document by document (fp32), within rounding of hfmeg's float64 run
    (`_bounds`); greedy generation at TP 2 × PP 2 as transformers' (with its cache: the recurrent form). The
    per-head A_log and dt_bias gradients are sums over every token: transformers' own chunked and token-by-token
    torch forms differ by 5.8e-5 relative on this model, where a fixed 1e-4 stood."""
    folder = tiny[kind]
    ref_logits, ref_grads = _reference(folder)
    prompt = _packed()[0][:1, :12]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    want = model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    results = {}
    for part in spawn(_sharded, 4, str(folder)):  # a PP layout's logits come from its last stage's ranks
        results.update(part)
    assert torch.equal(results["generated"], want), (results["generated"], want)
    logit_bound, grad_bounds = _bounds(folder, ref_logits, ref_grads)
    for layout in _logit_layouts(folder):
        within((results[("logits", *layout)] - ref_logits).abs().max().item(), logit_bound, "packed logit diff",
               layout)
    for tp, sp in GRAD_LAYOUTS:
        grads = results[("grads", tp, sp)]
        assert sorted(grads) == sorted(ref_grads) == sorted(grad_bounds), (tp, sp)
        for name, g in grads.items():
            ref = ref_grads[name]
            within(((g - ref).abs().max() / ref.abs().max()).item(), grad_bounds[name], "grad relative",
                   (tp, sp, name))


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_bit_exact(tiny, tmp_path, kind):
    """HF -> TP2 x PP2 and TP4 -> HF, every tensor bit for bit (the MoE model's shards hold every expert once, so
    they serve any EP size)."""
    for tp, pp in ((2, 2), (4, 1)):
        mp, hf = tmp_path / f"mp{tp}{pp}", tmp_path / f"hf{tp}{pp}"
        hf_to_mp(tiny[kind], mp, tp=tp, pp=pp)
        mp_to_hf(mp, hf)
        assert assert_same_tensors(tiny[kind], hf) > 0, (tp, pp)
        shutil.rmtree(mp), shutil.rmtree(hf)


def test_refusals_name_the_field():
    cfg = model_config_from_hf(tiny_config("qwen3_5"))
    with pytest.raises(UnsupportedConfigError, match="field layer_types: linear_attention layers .* parallel.cp=2"):
        check_cp(cfg, 2)
    with pytest.raises(UnsupportedConfigError, match="field layer_types: \\['sliding_attention'\\]"):
        model_config_from_hf(tiny_config("qwen3_5", layer_types=["sliding_attention"] + ["full_attention"] * 3))
    with pytest.raises(UnsupportedConfigError, match="field linear_num_value_heads"):
        model_config_from_hf(tiny_config("qwen3_5", linear_num_value_heads=6))


@pytest.mark.parametrize("kind", KINDS)
def test_planner_memory_matches_the_meter_exactly(kind):
    """The planner's activation count of the Gated DeltaNet and gated attention layers (and the MoE blocks) against
    the saved-tensor meter, byte for byte (fp32, the CPU path), on rows of 100 tokens (two delta-rule chunks, the
    second padded): TP2 with SP, and PP2 with selective recompute; the optimizer's buffers and state too. (The MoE
    model's load-balancing loss is off: its last-stage terms are not the planner's yet, for any MoE family.)"""
    from hfmeg.optim.config import OptimizerConfig
    from hfmeg.plan.layout import PlanLayout
    from hfmeg.plan.measure import Case, measure_cases
    from hfmeg.plan.memory import stage_memory

    cfg = model_config_from_hf(tiny_config(kind, output_router_logits=False))
    cases = [Case(cfg, PlanLayout(2, 1, 1, 2), 2, 100, 5000),
             Case(cfg, PlanLayout(1, 2, 1, 2, recompute="selective"), 4, 100, 5000)]
    for case, per_rank in zip(cases, measure_cases(cases, steps=0)):
        opt = OptimizerConfig(mode=case.layout.optimizer, bucket_size=case.bucket_size)
        for r in per_rank:
            m = stage_memory(cfg, case.layout, r["pp_rank"], case.global_batch, case.seq_len, 4, opt, dense_mask=True)
            assert m.activations == r["activations"], (case.layout.name(), r)
            assert m.param_buffer + m.grad_buffer == r["buffers"], (case.layout.name(), r)
            assert m.optimizer_state == r["optimizer_state"], (case.layout.name(), r)


@pytest.mark.parametrize("kind", KINDS)
def test_num_params_is_transformers_count(kind):
    """`ModelConfig.num_params` (MFU, reports) counts the linear-attention layers and the gate rows exactly."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(kind))
    assert model_config_from_hf(tiny_config(kind)).num_params() == sum(p.numel() for p in model.parameters())


def test_recompute_gives_the_same_gradients(tiny):
    """Selective recompute (the Gated DeltaNet core and the attention core checkpointed) and full recompute give
    the gradients of no recompute, bit for bit, on the packed rows."""
    ids, pos, seg, labels = _packed()
    grads = {}
    for mode in ("none", "selective", "full"):
        chunk = load_chunks(HFCheckpoint(tiny["qwen3_5"]), make_ps(), recompute=mode)[0]
        chunk(ids, labels=labels, position_ids=pos, segment_ids=seg).sum().backward()
        grads[mode] = {n: p.grad for n, p in chunk.named_parameters()}
    for mode in ("selective", "full"):
        assert all(torch.equal(grads[mode][n], g) for n, g in grads["none"].items()), mode


def test_moe_with_experts_over_ep_ranks_and_its_load_balancing_loss(tmp_path):
    """The MoE model through the MoE parity harness (tests/test_moe_parity.py, unpacked rows, the load-balancing
    loss on): TP ∈ {1, 2} × EP ∈ {1, 2} with the data-parallel wrapper finishing the gradients: logits, the loss
    with its load-balancing term and every gradient within rounding of transformers' float64 run
    (bounds.parity_bounds), an EP 2 greedy generation."""
    from test_moe_parity import NEW_TOKENS as NEW, PROMPT, _assert_parity, _check_layouts, _reference as moe_reference

    folder = save_tiny("qwen3_5_moe", tmp_path / "moe")
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    ref = moe_reference(folder, ids, tmp_path)
    bounds = parity_bounds(ref, moe_reference(folder, ids, tmp_path, torch.float64))
    expected = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).generate(
        PROMPT, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    layouts = [(1, 1, False, 1), (2, 1, True, 1), (1, 1, False, 2), (2, 1, True, 2)]
    _assert_parity(spawn(_check_layouts, 4, str(folder), ids, ref, PROMPT, layouts), layouts, ref, bounds, expected)
