"""The trainer on a tiny Mixtral with expert parallelism: EP2 x TP2 on 4 gloo ranks, 3 steps.

The run logs the min/max tokens per expert of every MoE layer in metrics.jsonl (global
load: every routed slot counted once, so the min and max of a layer are bounded by its
routed slots) and exports a folder transformers loads. The tokenizer is stories260K's,
with a model vocabulary to match it.
"""

from __future__ import annotations

import shutil

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


def test_ep2_tp2_run_logs_expert_load_and_exports(tmp_path):
    stories = stories_or_skip()
    if not ALPACA.is_file():
        pytest.skip(f"{ALPACA} is absent")
    model = save_tiny("mixtral", tmp_path / "mixtral", vocab_size=512, output_router_logits=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(stories / name, model / name)
    cfg = TrainConfig(
        model=ModelArgs(path=str(model), dtype="fp32"),
        parallel=ParallelArgs(tp=2, ep=2, sequence_parallel=True),
        optim=OptimizerConfig(lr=1e-3, eps=1e-5),
        lr=LRScheduleConfig(warmup_steps=1, total_steps=STEPS),
        data=DataConfig(sources=[SourceConfig(str(ALPACA))], seq_len=SEQ),
        train=LoopArgs(micro_batch_size=1, global_batch_size=GBS, max_steps=STEPS, eval_every=0),
        checkpoint=CheckpointArgs(out=str(tmp_path / "out"), save_every=0, keep_last=1),
        tensorboard=False,
    )
    hf = spawn(_run, 4, cfg)[0]
    rows = [r for r in read_metrics(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert len(rows) == STEPS
    slots = 2 * SEQ * 2  # the last micro-batch of each of the 2 DP ranks: SEQ tokens x top-2
    for r in rows:
        assert sorted(r["expert_load"]) == ["0", "1"], r
        for low, high in r["expert_load"].values():
            assert 0 <= low <= high <= slots and low * 4 <= slots <= high * 4, r
    AutoModelForCausalLM.from_pretrained(hf)  # every expert was exported
