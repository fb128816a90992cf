"""Gemma 4 E2B and E4B as released: tiny checkpoints built from their published configs (`tests/releases/`, sizes
shrunk, every other field as published, each file naming its source) against transformers and peft.

What they add to the 31B/26B-A4B (`test_gemma4_releases.py`): per-layer input embeddings (a second embedding table,
a projection of the token embedding, and each layer's gate, projection and norm) and KV sharing (the last layers
attend with the keys and values of the last earlier layer of their type); the E2B's reusing layers have double-wide
MLPs and its one KV head is replicated over TP.
- the configs read as transformers reads them: which layer reuses whose keys, which MLPs are wide, every parameter
  counted;
- one 4-rank world per release: logits equal to transformers' and greedy generation equal, LoRA (peft's projection
  names) logits and loss equal to peft's and its adapter gradients as close to peft's float64 ones as peft's own fp32
  ones are, within bounds derived from float64 runs (test_gemma4_releases.float64_reference), the peft adapter imported onto shards and exported back bit for
  bit, HF -> shards -> HF bit-exact: both at TP2 x PP2 (the E2B's one KV head replicated, its `k_proj`/`v_proj`
  adapters' B rows with it: tests/test_kv_replication_lora.py; the E4B split evenly, a reader on the second stage
  of a producer on the first);
- CP2 x TP2 (SP), CP2 x PP2 and, split evenly (readers on the stage after their producers), CP2 x PP2, TP2 x PP2
  (SP) and CP2 x PP2 interleaved over 2 virtual stages a rank, against one process, every gradient (tests/test_cp_parity.py's check): the producers' keys and values are
  reused gathered, and sent with the activations to a later stage; the per-layer inputs' gradients, and the shared
  keys' and values', flow back between stages;
- 3 trainer steps with LoRA at TP2 x PP2 (the E4B split evenly).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from convert_helpers import assert_same_tensors
from safetensors.torch import load_file
from test_gemma4_releases import (_parity, check_parity_rows, float64_reference, make_adapter, release_config,
                                  save_release, transformers_reference)
from transformers import AutoModelForCausalLM

from hfmeg.checkpoint.convert import hf_to_mp, mp_to_hf
from hfmeg.families import model_config_from_hf
from hfmeg.families.llama import PROJECTIONS
from hfmeg.parallel.launch import spawn
from hfmeg.plan.flops import layer_matmul_params
from hfmeg.peft.adapter_files import WEIGHTS_FILE

# release: (LoRA targets, LoRA layouts (tp, pp, ep), pipeline split). The E2B's split keeps layers 3-9 (its
# producers 3 and 4 and their readers 5-9) on one stage; the E4B's is even (0-5 | 6-11: layer 11 on the second stage
# reads the keys and values of layer 5 on the first, sent with the activations, `models/shared_kv.py`).
# Every projection, the E2B's double-wide MLPs included (their adapters take the layer rule's shapes).
CASES = {"gemma-4-E2B": (list(PROJECTIONS), [(2, 2, 1)], [3, 7]),
         "gemma-4-E4B": (list(PROJECTIONS), [(2, 2, 1)], None)}


def test_release_configs_are_read():
    e2b = model_config_from_hf(release_config("gemma-4-E2B"))
    assert e2b.kv_source == (0, 1, 2, 3, 4, 3, 3, 3, 3, 4)  # sliding readers take layer 3's, the full one 4's
    assert e2b.wide_mlp_layers == (5, 6, 7, 8, 9) and e2b.ffn_size_of(5) == 128 and e2b.ffn_size_of(4) == 64
    assert e2b.per_layer_input_size == 8 and e2b.stage_width == 32 + 10 * 8
    assert [e2b.stores_kv(i) for i in (2, 3, 4, 5)] == [False, True, True, False]
    a = e2b.attention_shape(9)  # the full layer's shape, borrowed from layer 4, with no K/V rows
    assert (a.num_kv_heads, a.head_dim, a.kv_parts) == (1, 16, 0) and e2b.kv_replicas(2, 9) == 1
    # The planner's and the MFU's count of layer 9: q alone (8 heads x 16), o, the wide GeGLU MLP, the per-layer
    # input's gate and projection and its share (8 rows) of the first stage's projection
    h = 32
    assert layer_matmul_params(e2b, 9) == h * 8 * 16 + 8 * 16 * h + 3 * h * 128 + 3 * h * 8
    e4b = model_config_from_hf(release_config("gemma-4-E4B"))
    assert e4b.kv_source == (0, 1, 2, 3, 4, 5, 6, 6, 6, 6, 6, 5) and e4b.wide_mlp_layers == ()
    for name in CASES:  # every parameter and each layer's scalar
        model = AutoModelForCausalLM.from_config(release_config(name))
        held = sum(p.numel() for p in model.parameters()) + sum(b.numel() for n, b in model.named_buffers()
                                                                  if n.endswith("layer_scalar"))
        assert model_config_from_hf(release_config(name)).num_params() == held, name


@pytest.mark.parametrize("release", CASES)
def test_release_parity_lora_and_round_trip(release, tmp_path):
    targets, layouts, pp_layers = CASES[release]
    base = save_release(release, tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "adapter", targets)
    peft_names = set(load_file(str(adapter / WEIGHTS_FILE)))
    # the reusing layers have q_proj alone: peft finds no k_proj or v_proj there
    assert any(".9.self_attn.q_proj" in k for k in peft_names)
    assert not any(".9.self_attn.k_proj" in k for k in peft_names) and any(".4.self_attn.k_proj" in k for k in peft_names)
    hf_to_mp(base, tmp_path / "mp", tp=2, pp=2, pp_layers=pp_layers)
    mp_to_hf(tmp_path / "mp", tmp_path / "back")
    assert assert_same_tensors(base, tmp_path / "back") > 0
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    # Twelve layers (the E4B) are worse conditioned than the 31B's six: fp32's error moves with the summation order
    # by more than one order's error shows, so peft's worst over transformers' two attention paths is the scale.
    exact, bounds = float64_reference(base, adapter, ids, ("eager", "sdpa"))
    rows = [r for rank in spawn(_parity, 4, str(base), str(adapter), ids, str(tmp_path / "lora_shards"), layouts,
                                exact, transformers_reference(base, adapter, ids), pp_layers) for r in rank]
    check_parity_rows(rows, layouts, peft_names, bounds)  # bounds: the wider of eager's and SDPA's


def test_releases_under_context_parallelism_and_kv_shared_across_stages(tmp_path):
    """Both releases on packed and plain rows of 32 at CP2 x TP2 (SP, full recompute), CP2 x PP2 with 3 layers on the
    first stage (the producers and their readers on the second), and split evenly (the E2B's 0-4 | 5-9, the E4B's
    0-5 | 6-11: producers on the first stage, readers of theirs on the second, the keys and values sent with the
    activations, `models/shared_kv.py`) at CP2 x PP2, at TP2 x PP2 (SP, full recompute; the E2B's KV head
    replicated) and interleaved over 2 virtual stages a rank at CP2 x PP2 (4 chunks, every boundary crossed): logits, loss and every gradient (the per-layer table's and projection's, and the producers' k/v
    projections' through the readers' use on the next stage, included) equal one process's (tests/test_cp_parity.py's
    check)."""
    from test_cp_parity import Layout, _run

    layouts = [Layout(2, 2, sp=True, recompute="full"), Layout(1, 2, 2, pp_first=3),
               Layout(1, 2, 2), Layout(2, 1, 2, sp=True, recompute="full"),
               Layout(1, 2, 2, vpp=2, schedule="interleaved", micro=2)]
    folders = {name: str(save_release(name, tmp_path / name)) for name in CASES}
    _run(4, folders, layouts, list(folders))


def _train(cfgs):
    from hfmeg.train.trainer import Trainer

    for cfg in cfgs:
        Trainer(cfg).run()


def test_three_lora_steps_and_export(tmp_path):
    """3 trainer steps with LoRA (fp32, alpaca rows of 64 tokens) at each release's layout (TP2 x PP2), in one world:
    three finite losses each."""
    from helpers import stories_or_skip
    from hfmeg.data import DataConfig, SourceConfig
    from hfmeg.optim.config import OptimizerConfig
    from hfmeg.peft.config import PeftConfig
    from hfmeg.train.config import CheckpointArgs, LoopArgs, ModelArgs, ParallelArgs, TrainConfig
    from hfmeg.train.metrics import read_metrics
    from tiny_models import ASSETS

    stories, alpaca = stories_or_skip(), ASSETS / "data" / "alpaca_en_demo.json"
    if not alpaca.is_file():
        pytest.skip(f"{alpaca} is absent")
    cfgs = []
    for name, (targets, layouts, pp_layers) in CASES.items():
        model = save_release(name, tmp_path / name)
        for f in ("tokenizer.json", "tokenizer_config.json"):  # stories260K's ids (< 512) fit the vocabulary
            shutil.copy(stories / f, model / f)
        tp = layouts[0][0]
        cfgs.append(TrainConfig(model=ModelArgs(path=str(model), dtype="fp32"),
                                parallel=ParallelArgs(tp=tp, pp=2, pp_layers=pp_layers),
                                optim=OptimizerConfig(lr=1e-3, eps=1e-5),
                                peft=PeftConfig(method="lora", r=4, target_modules=targets),
                                data=DataConfig(sources=[SourceConfig(str(alpaca))], seq_len=64),
                                train=LoopArgs(micro_batch_size=1, global_batch_size=4 // tp, max_steps=3, eval_every=0),
                                checkpoint=CheckpointArgs(out=str(tmp_path / f"{name}-out"), save_every=0, keep_last=1),
                                report_to=[]))
    spawn(_train, 4, cfgs)
    for cfg in cfgs:
        out = Path(cfg.checkpoint.out)
        losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
        assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses))), (out, losses)
