"""Preference tuning throughput and memory: hfmeg's DPO (full and LoRA) against TRL's DPOTrainer, same model and pairs.

Every mode trains the same random LLaMA-shaped model on the same preference pairs (the first `--pairs` records
of the asset `dpo_en_demo.json`, its conversation as the prompt string and its answers as strings, tokenised
by stories260K's tokenizer) for `--steps` optimizer steps at `--seq` tokens per sequence, each in processes of
its own, so each mode's peak RSS (CUDA bytes on a GPU) is its own:

- `full`: hfmeg's trainer (`hfmeg train` in-process at `--tp` x `--pp`, DP filling `--world`), DPO's sigmoid
  loss against a frozen reference copy laid out like the policy;
- `full_simpo`: the same, SimPO (reference-free): its peak lacks the reference copy, so `full - full_simpo` is
  what the copy costs;
- `lora`: LoRA (rank `--r`, all-linear) against the base with the adapters off: no second copy;
- `trl`: the anchor, TRL's DPOTrainer (full, a reference model beside it) in one process on the same pairs,
  `per_device_train_batch_size` `--trl-batch` pairs a step.

Reported per mode: answer tokens trained per second (the tokens whose log-probabilities the loss reads,
counted alike by both: hfmeg's label tokens, TRL's completion mask) over the steps after `--warmup`, the
peak memory, and the ratios hfmeg / TRL; hfmeg packs several pairs into its rows (data/pairs.py), TRL pads
each batch to its longest sequence. The last line printed is one JSON object. With no arguments it runs a
small CPU shape in a few minutes.

    .venv/bin/python tools/bench_dpo.py --hidden 512 --layers 8 --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from bench_args import add_layout_model_args, at_least, peak_bytes
from bench_optimizer import make_model

from hfmeg.data import DataConfig, SourceConfig
from hfmeg.optim.config import OptimizerConfig
from hfmeg.optim.lr_schedule import LRScheduleConfig
from hfmeg.parallel.launch import spawn
from hfmeg.peft.config import PeftConfig
from hfmeg.train.config import CheckpointArgs, LoopArgs, ModelArgs, ParallelArgs, TrainConfig
from hfmeg.train.metrics import read_metrics
from hfmeg.train.preference import PreferenceConfig
from hfmeg.train.trainer import Trainer

ASSETS = Path(__file__).resolve().parents[1].parent / "shared" / "assets"
RECORDS = ASSETS / "data" / "dpo_en_demo.json"
TOKENIZER = ASSETS / "models" / "stories260K"
MODES = ("full", "full_simpo", "lora", "trl")


def _peak() -> float:
    return peak_bytes(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))


def write_pairs(path: Path, n: int) -> Path:
    """The first `n` asset records as prompt / chosen / rejected strings (a JSON list)."""
    records = json.loads(RECORDS.read_text())[:n]
    pairs = [dict(prompt="\n".join(m["value"] for m in r["conversations"]), chosen=r["chosen"]["value"],
                  rejected=r["rejected"]["value"]) for r in records]
    path.write_text(json.dumps(pairs))
    return path


def threads_per_rank(world: int) -> int:
    """Intra-op threads each rank computes with on a CPU: the cores shared out, as accelerate does for TRL's
    process (spawned gloo ranks start with one)."""
    return max(1, len(os.sched_getaffinity(0)) // world)


def _hfmeg_rank(mode: str, model: str, data: str, out: str, a) -> dict:
    torch.set_num_threads(threads_per_rank(a.world))
    cfg = TrainConfig(
        model=ModelArgs(path=model, dtype="auto"),
        parallel=ParallelArgs(tp=a.tp, pp=a.pp),
        optim=OptimizerConfig(lr=1e-5),
        lr=LRScheduleConfig(warmup_steps=0),
        data=DataConfig(sources=[SourceConfig(data)], format="preference", seq_len=a.seq, prefetch=1),
        preference=PreferenceConfig(loss_type="simpo" if mode == "full_simpo" else "sigmoid"),
        peft=PeftConfig(method="lora" if mode == "lora" else "none", r=a.r, alpha=2.0 * a.r, dropout=0.0),
        train=LoopArgs(micro_batch_size=2, global_batch_size=a.rows, max_steps=a.warmup + a.steps),
        checkpoint=CheckpointArgs(out=out), report_to=[])
    Trainer(cfg).run()
    peak = torch.tensor([_peak()])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    rows = [r for r in read_metrics(Path(out) / "metrics.jsonl") if "loss" in r][a.warmup:]
    # tokens_per_s is the step's rows x seq_len over its time
    seconds = sum(a.rows * a.seq / r["tokens_per_s"] for r in rows)
    return dict(answer_tokens_per_s=sum(r["tokens"] for r in rows) / seconds, peak_bytes=int(peak.item()),
                steps=len(rows))


def _trl_rank(model: str, data: str, out: str, a) -> dict:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.set_num_threads(threads_per_rank(1))
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    class Clock(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    args = DPOConfig(output_dir=out, max_steps=a.warmup + a.steps, per_device_train_batch_size=a.trl_batch,
                     max_length=a.seq, learning_rate=1e-5, report_to="none", save_strategy="no", logging_steps=1,
                     use_cpu=not torch.cuda.is_available(), bf16=dtype == torch.bfloat16, dataloader_num_workers=0)
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args,
                         train_dataset=Dataset.from_list(json.loads(Path(data).read_text())),
                         processing_class=AutoTokenizer.from_pretrained(model))
    answer_tokens = []
    collate = trainer.data_collator

    def counting(examples):
        batch = collate(examples)
        answer_tokens.append(int(batch["completion_mask"].sum()))
        return batch

    trainer.data_collator = counting
    clock = Clock()
    trainer.add_callback(clock)
    trainer.train()
    steps = list(zip(clock.times, answer_tokens))[a.warmup:]
    return dict(answer_tokens_per_s=sum(n for _, n in steps) / sum(t for t, _ in steps), peak_bytes=int(_peak()),
                steps=len(steps))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_layout_model_args(ap, world=1, tp=1, hidden=512, layers=8)  # --world: the hfmeg modes' gloo ranks
    ap.add_argument("--seq", type=at_least(16), default=512, help="tokens per sequence (TRL's max_length)")
    ap.add_argument("--rows", type=at_least(2), default=4, help="hfmeg's rows per step (even: row pairs)")
    ap.add_argument("--trl-batch", type=at_least(1), default=2, help="TRL's pairs per step")
    ap.add_argument("--pairs", type=at_least(2), default=64, help="asset records used")
    ap.add_argument("--r", type=at_least(1), default=16, help="LoRA rank")
    ap.add_argument("--steps", type=at_least(1), default=4)
    ap.add_argument("--warmup", type=at_least(0), default=1)
    a = ap.parse_args(argv)
    a.vocab = 512  # stories260K's tokenizer
    if not RECORDS.is_file():
        ap.error(f"{RECORDS} is absent (../shared/assets beside the repository)")
    if a.world % (a.tp * a.pp) or (a.hidden // 64) % a.tp or a.layers < a.pp or a.rows % 2:
        ap.error("--tp x --pp must divide --world, --tp the head count (--hidden / 64), --pp <= --layers; "
                 "--rows even")
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        params = make_model(model, a)
        from transformers import AutoTokenizer
        AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(model)  # the runs read it beside the weights
        data = str(write_pairs(Path(tmp) / "pairs.json", a.pairs))
        rows = {mode: (spawn(_trl_rank, 1, str(model), data, f"{tmp}/{mode}", a, timeout_s=3600) if mode == "trl"
                       else spawn(_hfmeg_rank, a.world, mode, str(model), data, f"{tmp}/{mode}", a,
                                  timeout_s=3600))[0] for mode in MODES}
    peak = "peak CUDA MiB" if torch.cuda.is_available() else "peak RSS MiB"
    print(f"{'mode':11} {'answer tok/s':>13} {peak:>13}")
    for mode, r in rows.items():
        print(f"{mode:11} {r['answer_tokens_per_s']:13.1f} {r['peak_bytes'] / 2**20:13.1f}")
    full, simpo, lora, trl = (rows[m] for m in MODES)
    print(json.dumps(dict(device="cuda" if torch.cuda.is_available() else "cpu", world=a.world, tp=a.tp, pp=a.pp,
                          cpu_threads_per_rank={"hfmeg": threads_per_rank(a.world), "trl": threads_per_rank(1)},
                          hidden=a.hidden, layers=a.layers, seq=a.seq, params=params, model_bytes=4 * params,
                          by_mode=rows,
                          full_vs_trl_tokens_per_s=full["answer_tokens_per_s"] / trl["answer_tokens_per_s"],
                          lora_vs_trl_tokens_per_s=lora["answer_tokens_per_s"] / trl["answer_tokens_per_s"],
                          full_vs_trl_peak=full["peak_bytes"] / trl["peak_bytes"],
                          reference_copy_bytes=full["peak_bytes"] - simpo["peak_bytes"],
                          lora_vs_full_peak=lora["peak_bytes"] / full["peak_bytes"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
