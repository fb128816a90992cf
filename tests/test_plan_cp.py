"""Context parallelism in the planner: the activation model against the meter, and the search's choices.

The saved-tensor meter runs a whole model chunk (embedding, layers, head with labels)
on each CP rank of a gloo world; the planner's count must agree within 5 % (it
counts storages exactly, so it agrees to the byte), and CP = N must hold at most
1.15 / N of CP 1's activations per rank at this shape.
"""

from __future__ import annotations

import json
import re

import torch
from transformers import LlamaConfig

from helpers import make_ps
from hfmeg.config import model_config_from_hf
from hfmeg.models.decoder import ModelChunk
from hfmeg.parallel.activation_meter import SavedTensorMeter
from hfmeg.parallel.launch import spawn
from hfmeg.plan.activations import Shape, chunk_bytes
from hfmeg.plan.cli import main
from hfmeg.plan.layout import PlanLayout, parse_layout

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
