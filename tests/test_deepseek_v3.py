"""DeepSeek-V3 (`hfmeg/families/deepseek_v3.py`): its config reader and refusals, HF -> shards -> HF bit-exact, and
logits and every gradient against transformers (fp32) on rows packed with several documents.

The tiny checkpoint (`tests/tiny_models.py`) has MLA with a query latent, interleaved RoPE and YaRN's two mscales.
Parity runs in one 2-process gloo world: TP1 (each rank alone), TP2, TP2 with SP; the reference is transformers
run on each document alone.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from bounds import within
from convert_helpers import assert_same_tensors
from helpers import make_ps
from hfmeg.checkpoint.convert import hf_to_mp, mp_to_hf
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.checkpoint.rules import chunk_rules, to_hf
from hfmeg.errors import UnsupportedConfigError
from hfmeg.families import model_config_from_hf
from hfmeg.parallel.comm import sync_sequence_parallel_grads
from hfmeg.parallel.launch import spawn
from tiny_models import save_tiny, tiny_config

DENSE = dict(first_k_dense_replace=3)  # every layer dense
DOCS = (7, 9)  # one packed row of two documents
LAYOUTS = [(1, False), (2, False), (2, True)]  # (tp, sp)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v3")
    return {"dense": save_tiny("deepseek_v3", root / "dense", **DENSE),
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


@pytest.mark.parametrize("field, value", [("attention_bias", True), ("num_key_value_heads", 2),
                                          ("first_k_dense_replace", 1)])
def test_unbuilt_fields_are_refused_naming_the_field(field, value):
    with pytest.raises(UnsupportedConfigError, match=f"^config.json field {field}:"):
        model_config_from_hf(tiny_config("deepseek_v3", **{**DENSE, field: value}))


@pytest.mark.parametrize("kind", ["dense", "dense_no_q_latent"])
def test_round_trip_bit_exact(kind, checkpoints, tmp_path):
    for tp, pp in ((2, 2), (2, 1)):
        mp, out = tmp_path / f"mp{tp}{pp}", tmp_path / f"hf{tp}{pp}"
        hf_to_mp(checkpoints[kind], mp, tp=tp, pp=pp)
        mp_to_hf(mp, out)
        assert assert_same_tensors(checkpoints[kind], out) > 0


def _packed():
    """ids, position ids, segment ids, labels `[1, s]` of one row packing `DOCS` (no label across a document's end)."""
    ids = torch.randint(0, 300, (1, sum(DOCS)), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0)
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(DOCS)]).unsqueeze(0)
    labels = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in ids[0].split(DOCS)]).unsqueeze(0)
    return ids, pos, seg, labels


def _reference(folder):
    """transformers on each document alone: logits `[1, s, V]`, the mean loss over the row's labels, gradients."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    ids, _, _, labels = _packed()
    logits = [model(d.unsqueeze(0)).logits for d in ids[0].split(DOCS)]
    logits = torch.cat(logits, dim=1)
    loss = torch.nn.functional.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="sum")
    (loss / (labels != -100).sum()).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def _gather_tp(t, ps):
    if ps.tp == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(ps.tp)]
    dist.all_gather(parts, t.contiguous(), group=ps.tp_group)
    return parts


def _check_layouts(folder):
    ref_logits, ref_grads = _reference(folder)
    ids, pos, seg, labels = _packed()
    report = []
    for tp, sp in LAYOUTS:
        ps = make_ps(tp=tp, sp=sp)
        chunk = load_chunks(HFCheckpoint(folder), ps)[0]
        with torch.no_grad():
            logits = torch.cat(_gather_tp(chunk(ids, position_ids=pos, segment_ids=seg), ps), dim=-1)
        per_token = chunk(ids, position_ids=pos, segment_ids=seg, labels=labels)
        (per_token.sum() / (labels != -100).sum()).backward()
        sync_sequence_parallel_grads([chunk], ps)
        params = dict(chunk.named_parameters())
        worst, seen = 0.0, set()
        for rule in chunk_rules(chunk.cfg, chunk.layer_ids, True, True, chunk.experts):
            for name, g in to_hf(rule, _gather_tp(params[rule.local].grad, ps), chunk.cfg).items():
                ref = ref_grads[name]
                worst = max(worst, ((g - ref).abs().max() / ref.abs().max()).item())
                seen.add(name)
        report.append(dict(tp=tp, sp=sp, logit_diff=(logits[..., :300] - ref_logits).abs().max().item(),
                           grad_rel=worst, missing=sorted(set(ref_grads) - seen)))
    return report


@pytest.mark.parametrize("kind", ["dense", "dense_no_q_latent"])
def test_parity_with_transformers_on_packed_rows(kind, checkpoints):
    for row in spawn(_check_layouts, 2, str(checkpoints[kind]))[0]:
        within(row["logit_diff"], 1e-4, "logit_diff", row)
        within(row["grad_rel"], 1e-4, "grad_rel", row)
        assert not row["missing"], row
