"""LoRA and DoRA runs of the trainer vs `peft` + AdamW, and the exports `peft` and transformers load.

The base is stories260K (a real LLaMA) on alpaca_en_demo.json, one example per row
(`packing: false`, so the transformers reference needs no document mask), fp32. The
adapter starts from one `peft` made (`peft.init_from`: its default init, B = 0), so
the reference starts from the same adapter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from bounds import within
from helpers import make_ps
from peft import LoraConfig, PeftModel, get_peft_model
from peft_helpers import hfmeg_chunks
from safetensors.torch import load_file
from test_train import _losses, _run
from tiny_models import ASSETS
from transformers import AutoModelForCausalLM, AutoTokenizer

from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.checkpoint.mp_layout import MPLayout
from hfmeg.data import DataConfig, SourceConfig, build_data
from hfmeg.models.generate import full_logits
from hfmeg.optim.config import OptimizerConfig
from hfmeg.optim.lr_schedule import LRScheduleConfig, lr_at
from hfmeg.parallel.launch import spawn
from hfmeg.peft.adapter_files import WEIGHTS_FILE, assemble, read_adapter_shard
from hfmeg.peft.adapters import attach
from hfmeg.peft.config import PeftConfig
from hfmeg.peft.export import read_info
from hfmeg.train.config import (
    CheckpointArgs,
    LoopArgs,
    ModelArgs,
    ParallelArgs,
    TrainConfig,
)

ALPACA = ASSETS / "data" / "alpaca_en_demo.json"
ROOT = Path(__file__).resolve().parents[1]
STEPS = 20


def _config(out: Path, base: Path, adapter: Path, *, tp=1, pp=1, steps=STEPS, save_every=0, resume="none",
            schedule_steps=None) -> TrainConfig:
    return TrainConfig(
        model=ModelArgs(path=str(base), dtype="fp32"),
        parallel=ParallelArgs(tp=tp, pp=pp),
        optim=OptimizerConfig(lr=1e-2, weight_decay=0.01, eps=1e-8, grad_clip=1.0),
        lr=LRScheduleConfig(warmup_steps=2, total_steps=schedule_steps or steps, min_lr=1e-3),
        data=DataConfig(sources=[SourceConfig(str(ALPACA))], seq_len=64, packing=False),
        peft=PeftConfig(method="lora", init_from=str(adapter)),
        train=LoopArgs(micro_batch_size=1, global_batch_size=4, max_steps=steps),
        checkpoint=CheckpointArgs(out=str(out), save_every=save_every, resume=resume, keep_last=2),
        report_to=[],
    )


def _peft_adamw_losses(cfg: TrainConfig, adapter: Path, base=None) -> list[float]:
    """Single process: transformers + peft + torch.optim.AdamW on the trainer's own batches (one DP rank);
    `base`: the transformers model (default: the run's base in fp32; a 4-bit one: tests/test_qlora_parity.py)."""
    if base is None:
        base = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32, attn_implementation="sdpa")
    model = PeftModel.from_pretrained(base, adapter, is_trainable=True)
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optim
    opt = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    data = build_data(cfg.data, AutoTokenizer.from_pretrained(cfg.model.path), dp_rank=0, dp_size=1,
                      micro_batch_size=1, global_batch_size=cfg.train.global_batch_size)
    losses = []
    try:
        for step in range(cfg.train.max_steps):
            batch = next(data)
            total = 0.0
            for mb in batch.microbatches:
                logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(),
                                                         reduction="sum") / batch.num_tokens
                loss.backward()
                total += loss.item()
            torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, o.lr, cfg.lr)
            opt.step()
            opt.zero_grad()
            losses.append(total)
    finally:
        data.close()
    return losses


def test_lora_training_matches_peft_and_exports(stories_lora, tmp_path):
    base, adapter0 = stories_lora
    ref = _peft_adamw_losses(_config(tmp_path / "ref", base, adapter0), adapter0)
    spawn(_run, 4, _config(tmp_path / "tp2pp2", base, adapter0, tp=2, pp=2))
    spawn(_run, 4, _config(tmp_path / "tp2dp2", base, adapter0, tp=2))
    for run in ("tp2pp2", "tp2dp2"):
        ours = _losses(tmp_path / run)
        assert len(ours) == STEPS
        # fp32 sums over ~250 tokens, orders differing by layout: ~1e-6 relative; the bound is 1e-4.
        within(max(abs(x - y) / abs(y) for x, y in zip(ours, ref)), 1e-4, f"lora {run} loss rel", (run, ours, ref))
    assert ref[-1] < ref[0]

    out = tmp_path / "tp2pp2"
    ckpt = sorted((out / "checkpoints").glob("iter_*"))[-1]
    assert not list(ckpt.glob("mp_rank_*/model.safetensors")), "a LoRA checkpoint holds adapters, not the base"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["peft_base"]["path"] == str(base) and len(state["peft_base"]["sha256"]) == 64
    # The PEFT folder holds exactly the checkpoint's adapters, and peft loads it onto the base.
    exported = load_file(str(out / "adapter" / WEIGHTS_FILE))
    trained = assemble(ckpt)
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)
    assert not all(torch.equal(exported[k], v) for k, v in load_file(str(adapter0 / WEIGHTS_FILE)).items())
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["base_model_name_or_path"] == str(base)
    ids = torch.tensor([[1, 365, 1122, 263, 931, 29892, 727, 471]]) % 512
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                               out / "adapter")
        with_adapter = peft_model(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)(ids).logits
    chunks, _ = hfmeg_chunks(base, out / "adapter", make_ps())
    ours = full_logits(chunks, make_ps(), ids)
    # fp32 logits of a 5-layer model: rounding differences ~1e-6; the contract's bound is 1e-4.
    within((ours - with_adapter).abs().max(), 1e-4, "export logits max-abs", None)
    within((merged - with_adapter).abs().max(), 1e-4, "merged logits max-abs", None)
    AutoTokenizer.from_pretrained(out / "hf")
    # The offline converter gives the same two folders from the checkpoint alone.
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_mp_to_hf.py"), "--mp",
                           str(out / "checkpoints"), "--out", str(tmp_path / "conv"),
                           "--merge", str(tmp_path / "conv_merged")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    again = load_file(str(tmp_path / "conv" / WEIGHTS_FILE))
    assert again.keys() == exported.keys() and all(torch.equal(again[k], exported[k]) for k in again)
    merged_files = [load_file(str(d / "model.safetensors")) for d in (out / "hf", tmp_path / "conv_merged")]
    assert all(torch.equal(merged_files[0][k], merged_files[1][k]) for k in merged_files[0])
    # both converted folders carry their cards, the adapter's as the run's own export writes it
    cards = [(d / "README.md").read_text() for d in (tmp_path / "conv", tmp_path / "conv_merged")]
    assert "library_name: peft" in cards[0] and "this folder is the LoRA adapter" in cards[0]
    assert "library_name: transformers" in cards[1]


def test_dora_training_matches_peft(stories_lora, tmp_path):
    """DoRA (its magnitudes trained, the row-parallel norm summed over TP) at TP2 x PP2 vs peft + AdamW."""
    base, _ = stories_lora
    torch.manual_seed(0)
    adapter0 = tmp_path / "dora0"
    get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                   LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True,
                              task_type="CAUSAL_LM")).save_pretrained(adapter0)
    ref = _peft_adamw_losses(_config(tmp_path / "ref", base, adapter0), adapter0)
    spawn(_run, 4, _config(tmp_path / "tp2pp2", base, adapter0, tp=2, pp=2))
    ours = _losses(tmp_path / "tp2pp2")
    assert len(ours) == STEPS and ref[-1] < ref[0]
    within(max(abs(x - y) / abs(y) for x, y in zip(ours, ref)), 1e-4, "dora loss rel", (ours, ref))  # as for LoRA
    config = json.loads((tmp_path / "tp2pp2" / "adapter" / "adapter_config.json").read_text())
    assert config["use_dora"] is True


def logits_from_shards(base: Path, ckpt: Path, ids: torch.Tensor):
    """hfmeg's fp32 logits with the adapters of a checkpoint's own shards on the base, at the checkpoint's layout
    (each rank its shard; the last stage's ranks return them, the others None)."""
    layout = MPLayout.read(ckpt)
    ps = make_ps(tp=layout.tp, pp=layout.pp)
    chunks = load_chunks(HFCheckpoint(base), ps, pp_layers=layout.pp_layers, dtype=torch.float32)
    cfg, _ = read_info(ckpt)
    for chunk in chunks:
        attach(chunk, cfg)
    read_adapter_shard(chunks, ckpt / layout.rank_dir(ps.tp_rank, ps.pp_rank), ps.tp_rank)
    with torch.no_grad():
        return full_logits(chunks, ps, ids)


def test_exports_of_a_tp4_run_load_in_peft_and_transformers(stories_lora, tmp_path):
    """A LoRA run at TP4 (the adapters' row-parallel A and column-parallel B in quarters): its adapter folder
    loads with PeftModel.from_pretrained and computes what hfmeg computes with the TP4 shards; its merged
    folder loads with AutoModelForCausalLM alone and computes what peft computes with the adapter."""
    base, adapter0 = stories_lora
    out = tmp_path / "tp4"
    spawn(_run, 4, _config(out, base, adapter0, tp=4, steps=3))
    ckpt = sorted((out / "checkpoints").glob("iter_*"))[-1]
    ids = torch.tensor([[1, 365, 1122, 263, 931, 29892, 727, 471]]) % 512
    ours = spawn(logits_from_shards, 4, base, ckpt, ids)[0]
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        with_adapter = PeftModel.from_pretrained(plain, out / "adapter")(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)(ids).logits
        effect = (with_adapter - AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)(ids).logits).abs()
    assert effect.max() > 1e-3, "three steps must move the adapter for the test to bite"
    # fp32 logits of a 5-layer model, TP4 sums in another order: ~1e-6; the contract's bound is 1e-4.
    assert (ours - with_adapter).abs().max() <= 1e-4
    assert (merged - with_adapter).abs().max() <= 1e-4
