"""Context parallelism in the planner: the activation model against the meter, the step-time terms
against their formula, and the search's choices.

The saved-tensor meter runs a whole model chunk (embedding, layers, head with labels)
on each CP rank of a gloo world; the planner's count must agree within 5 % (it
counts storages exactly, so it agrees to the byte), and CP = N must hold at most
1.15 / N of CP 1's activations per rank at this shape. The step time's CP terms (the
compute split and the per-layer K/V all-gather / reduce-scatter) are written out here
on a profile that isolates them.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from transformers import LlamaConfig

from helpers import make_ps
from hfmeg.families import model_config_from_hf
from hfmeg.models.decoder import ModelChunk
from hfmeg.parallel.activation_meter import SavedTensorMeter
from hfmeg.parallel.launch import spawn
from hfmeg.plan.activations import Shape, chunk_bytes
from hfmeg.plan.cli import main
from hfmeg.plan.hardware import ClusterSpec, gpu_spec
from hfmeg.plan.layout import PlanLayout, parse_layout
from hfmeg.plan.models import resolve_model
from hfmeg.plan.profile import Profile, default_profile
from hfmeg.plan.search import Job, best_layout, search
from hfmeg.plan.step_time import step_time

SEQ, LAYERS = 512, 4
HF = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS, num_attention_heads=8,
          num_key_value_heads=2, vocab_size=256, max_position_embeddings=SEQ)


def _measured(ps, recompute: str) -> int:
    torch.manual_seed(0)
    chunk = ModelChunk(model_config_from_hf(LlamaConfig(**HF)), ps, range(LAYERS), pre_process=True,
                       post_process=True, recompute=recompute)
    ids = torch.randint(0, 256, (1, SEQ // ps.cp))
    meter = SavedTensorMeter([chunk])
    with meter.hooks():
        loss = chunk(ids, labels=ids)
    del loss
    return meter.peak


def _rank():
    out = {}
    for cp in (1, 2, 4):
        ps = make_ps(world=1) if cp == 1 else make_ps(cp=cp)
        out[cp] = {rec: _measured(ps, rec) for rec in ("none", "selective")}
    return out


def test_activation_model_matches_the_meter_and_cp_divides_the_activations():
    measured = spawn(_rank, 4)
    cfg = model_config_from_hf(LlamaConfig(**HF))
    for rank in measured:
        for cp, by_mode in rank.items():
            for rec, got in by_mode.items():
                shape = Shape(1, SEQ, 1, False, 4, rec, cp=cp, dense_mask=cp > 1)  # CPU: SDPA with a dense mask
                predicted = chunk_bytes(cfg, shape, range(LAYERS), True, True)
                assert abs(predicted - got) <= 0.05 * got, (cp, rec, predicted, got)
                # The bound; here the ratio is 1.02-1.07 x 1/N (the all-gathered K/V and the mask).
                assert got * cp <= 1.15 * rank[1][rec], (cp, rec, got, rank[1][rec])


def test_plan_proposes_cp_for_long_sequences(capsys):
    assert parse_layout("tp2sp-cp4-pp2v2-dp8-mb1-full") == PlanLayout(2, 2, 8, 1, 2, "full", True, cp=4)
    assert main(["--seq-len", "32768", "--top", "3", "--json"]) == 0
    best = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "-cp" in best["layout"], best["layout"]
    # LLaMA-2-13B at 256k tokens on 16 x A100-40GB: no layout without CP fits, not even TP 8 with full recompute.
    assert main(["--model", "llama2-13b", "--gpu", "a100-40", "--gpus", "16", "--global-batch-size", "16",
                 "--seq-len", "262144"]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\s+\d+ tp", line)]
    assert table and all("-cp" in line for line in table), table


# A GPU profile with the planner's nonlinear parts switched off: one matmul efficiency at every size, no fixed
# costs, memory traffic free. What is left of a step's compute is FLOPs at a rate, of its TP-link time the CP
# collectives alone (TP 1), so both can be written out in full below.
FLAT = Profile("flat", 300e12, ((1.0, 0.5), (1e30, 0.5)), 0.4, 1e30, 0.0, 0.0, 0.0, link_efficiency=0.8)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_cp_step_time_terms_equal_their_formula(recompute):
    cfg = model_config_from_hf(LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                           num_attention_heads=16, num_key_value_heads=4, vocab_size=32000))
    b, s, gbs, e = 2, 8192, 8, 2
    h, d, f, nh, nkv, L = cfg.hidden_size, cfg.head_dim, cfg.ffn_size, cfg.num_heads, cfg.num_kv_heads, cfg.num_layers
    spec = gpu_spec("a100-40")
    compute = {}
    for n in (1, 2, 4):
        lay = PlanLayout(1, 1, 1, b, recompute=recompute, cp=n)
        t = step_time(cfg, lay, ClusterSpec(spec, n), FLAT, gbs, s, e)
        m, tok = gbs // b, b * s // n  # micro-batches; a rank's tokens of one: s / n of each row
        rate = FLAT.peak_flops * 0.5
        linear = 2 * tok * h * (nh + 2 * nkv) * d + 2 * tok * nh * d * h + 2 * tok * h * 2 * f + 2 * tok * f * h
        attn = 2 * b * nh * (s // n) * s * d / (FLAT.peak_flops * 0.4)  # its queries over the whole row
        head = 2 * tok * h * cfg.padded_vocab(1) / rate
        layer = 3 * (linear / rate + attn) + {"none": 0, "selective": attn, "full": linear / rate + attn}[recompute]
        compute[n] = m * (L * layer + 4 * head)  # head: forward, recomputed logits, two gradient GEMMs
        assert math.isclose(t.compute_s, compute[n], rel_tol=1e-9), (n, t.compute_s, compute[n])
        # Per layer: the K/V all-gather forward, its reduce-scatter backward, and the all-gather again where
        # the core is recomputed. A ring of n ranks inside a node: (n-1)/n of the 2e.b.nkv.s.d bytes
        # gathered, at NVLink x the profile's link efficiency, plus (n-1) latencies.
        kv_bytes = 2 * e * b * nkv * s * d
        latency = ClusterSpec(spec, n).intra_node_latency_s
        ring = (n - 1) / n * kv_bytes / (spec.intra_node_bytes_per_s * 0.8) + (n - 1) * latency
        kv = m * L * (2 + (recompute != "none")) * ring
        assert math.isclose(t.tp_comm_s, kv, rel_tol=1e-9, abs_tol=1e-15), (n, t.tp_comm_s, kv)
    # The split: every rank computes 1/n of CP 1's work (tokens and causal attention pairs alike).
    assert math.isclose(compute[2], compute[1] / 2, rel_tol=1e-9)
    assert math.isclose(compute[4], compute[1] / 4, rel_tol=1e-9)


def test_layout_auto_chooses_cp_where_nothing_else_fits():
    """`--layout auto`'s choice (`best_layout`, what train/auto_layout.py asks) for LLaMA-2-13B at 256k tokens
    on 16 x A100-40GB, the job of the CLI's table above: a CP layout, and no layout of the whole search without
    CP fits. (At 32k tokens the search proposes CP as the fastest, but on the built-in models a CP 1 layout,
    PP with full recompute, always fits too: PP divides the weights as well as the activations.)"""
    spec = gpu_spec("a100-40")
    job = Job(resolve_model("llama2-13b"), ClusterSpec(spec, 16),
              default_profile("a100-40", spec.peak_flops, spec.hbm_bytes_per_s), 16, 262144)
    fits = search(job)[0]
    assert fits and all(ev.layout.cp > 1 for ev in fits), [ev.layout.name() for ev in fits if ev.layout.cp == 1]
    assert best_layout(job).layout == fits[0].layout
