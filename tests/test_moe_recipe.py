"""The trainer on a tiny Mixtral (and gpt-oss) with expert parallelism on 4 gloo ranks.

EP2 x TP2, 3 steps (Mixtral and gpt-oss): the run logs the min/max tokens per expert of every MoE layer in metrics.jsonl (global
load: every routed slot counted once, so the min and max of a layer are bounded by its
routed slots) and exports a folder transformers loads. EP2 x expert-DP 2 with PowerSGD
(expert buckets compressed over their own group): a run resumed from its step-2
checkpoint repeats the uninterrupted run's steps 3 and 4 bit for bit. The tokenizer is
stories260K's, with a model vocabulary to match it.
"""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
from transformers import AutoModelForCausalLM

from helpers import stories_or_skip
from hfmeg.data import DataConfig, SourceConfig
from hfmeg.optim.config import OptimizerConfig
from hfmeg.optim.lr_schedule import LRScheduleConfig
from hfmeg.parallel.launch import spawn
from hfmeg.train.config import CheckpointArgs, LoopArgs, ModelArgs, ParallelArgs, TrainConfig
from hfmeg.train.metrics import read_metrics
from hfmeg.train.trainer import Trainer
from tiny_models import ASSETS, save_tiny

ALPACA = ASSETS / "data" / "alpaca_en_demo.json"
SEQ, GBS, STEPS = 64, 4, 3


def _run(cfg: TrainConfig):
    return Trainer(cfg).run().hf_folder


def _with_tokenizer(tmp_path, kind: str = "mixtral"):
    stories = stories_or_skip()
    if not ALPACA.is_file():
        pytest.skip(f"{ALPACA} is absent")
    model = save_tiny(kind, tmp_path / kind, vocab_size=512, output_router_logits=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(stories / name, model / name)
    return model


def _ep2_tp2(model, out, lr: float, **fields) -> TrainConfig:
    """A 3-step EP2 x TP2 (SP) run of `model` into `out`, no checkpoints on the way; `fields`: more TrainConfig."""
    return TrainConfig(
        model=ModelArgs(path=str(model), dtype="fp32"),
        parallel=ParallelArgs(tp=2, ep=2, sequence_parallel=True),
        optim=OptimizerConfig(lr=lr, eps=1e-5),
        lr=LRScheduleConfig(warmup_steps=1, total_steps=STEPS),
        data=DataConfig(sources=[SourceConfig(str(ALPACA))], seq_len=SEQ),
        train=LoopArgs(micro_batch_size=1, global_batch_size=GBS, max_steps=STEPS, eval_every=0),
        checkpoint=CheckpointArgs(out=str(out), save_every=0, keep_last=1),
        report_to=[],
        **fields,
    )


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_ep2_tp2_run_logs_expert_load_and_exports(tmp_path, kind):
    model = _with_tokenizer(tmp_path, kind)
    hf = spawn(_run, 4, _ep2_tp2(model, tmp_path / "out", lr=1e-3))[0]
    rows = [r for r in read_metrics(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert len(rows) == STEPS
    slots = 2 * SEQ * 2  # the last micro-batch of each of the 2 DP ranks: SEQ tokens x top-2
    for r in rows:
        assert sorted(r["expert_load"]) == ["0", "1"], r
        for low, high in r["expert_load"].values():
            assert 0 <= low <= high <= slots and low * 4 <= slots <= high * 4, r
    AutoModelForCausalLM.from_pretrained(hf)  # every expert was exported


def test_ep2_with_powersgd_resumes_exactly(tmp_path):
    model = _with_tokenizer(tmp_path)
    out = tmp_path / "out"
    cfg = TrainConfig(
        model=ModelArgs(path=str(model), dtype="fp32"),
        parallel=ParallelArgs(ep=2),
        optim=OptimizerConfig(lr=1e-3, eps=1e-5, compression="powersgd", powersgd_rank=2, compression_start_step=1),
        lr=LRScheduleConfig(warmup_steps=1, total_steps=4),
        data=DataConfig(sources=[SourceConfig(str(ALPACA))], seq_len=SEQ),
        train=LoopArgs(micro_batch_size=1, global_batch_size=8, max_steps=4, eval_every=0),
        checkpoint=CheckpointArgs(out=str(out), save_every=2, keep_last=3),
        report_to=[],
    )
    spawn(_run, 4, cfg)
    full = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert (out / "checkpoints" / "iter_0000002" / "optim" / "powersgd_pp000_tp00_dp003.safetensors").is_file()
    shutil.rmtree(out / "checkpoints" / "iter_0000004")
    (out / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
    (out / "metrics.jsonl").unlink()
    spawn(_run, 4, replace(cfg, checkpoint=replace(cfg.checkpoint, resume="auto")))
    resumed = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert len(full) == 4 and resumed == full[2:]


def test_lora_run_on_mixtral_at_ep2_tp2_exports_what_peft_and_transformers_load(tmp_path):
    """The trainer end to end with LoRA on experts, router and attention (`all-linear`) at EP2 x TP2: the
    adapter folder loads onto the base with peft and gives the merged folder's logits (which transformers
    loads alone), and the run trained: the adapter's B factors, zero at start, moved."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file

    from hfmeg.peft.config import PeftConfig

    model = _with_tokenizer(tmp_path)
    cfg = _ep2_tp2(model, tmp_path / "out", lr=1e-2, peft=PeftConfig(method="lora", r=4, target_modules=["all-linear"]))
    hf = spawn(_run, 4, cfg)[0]
    adapter = tmp_path / "out" / "adapter"
    tensors = load_file(adapter / "adapter_model.safetensors")
    assert any("experts" in k for k in tensors) and any("mlp.gate" in k for k in tensors)
    assert all(t.abs().max() > 0 for k, t in tensors.items() if "lora_B" in k)
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(hf)(ids).logits
        on_base = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), adapter)(ids).logits
    torch.testing.assert_close(on_base, merged, rtol=0, atol=1e-4)  # the bound, fp32 both
