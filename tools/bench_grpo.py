"""GRPO throughput: hfmeg's GRPO run against TRL's GRPOTrainer, same model, prompts, settings and engine, one run.

Both train stories260K (the asset) on the same story openings with the toy reward (`recipes/grpo_toy_rewards.py:
park`), `--num-generations` completions per prompt of at most `--max-completion-length` tokens, `--batch`
completions a step, DAPO loss, β 0, temperature 1, for `--steps` optimizer steps, each side in one CPU process
(its own, spawned, so neither warms the other's caches). The engine is transformers on both sides: TRL's
`generate` and hfmeg's in-process transformers engine (TRL cannot load vLLM beside this environment's
transformers; hfmeg's vLLM engine is timed with `--generator vllm`, hfmeg alone).

Reported per side, over the steps after `--warmup`:
- generation tokens/s: completion tokens sampled / seconds sampling them (hfmeg: `timing/generation_s` of its
  metrics; TRL: its `_generate`);
- training tokens/s: completion tokens trained / seconds of the steps less sampling and, for hfmeg, the weight
  push (`timing/weight_push_s`: the live shards gathered and copied into the engine's model, or exported to an HF
  folder in shared memory for vLLM; TRL's `generate` reads the live model and has none);
- end-to-end tokens/s: completion tokens / whole step seconds;
and the same per CPU second of the process (`*_tokens_per_cpu_s`: generation's and whole steps' CPU time, over the
steps after `--warmup` but the last, whose end only the run's end shows): on a machine shared with other work a
process waits for a core most of its wall time (at load average 20-60 on 2 cores, 3-5x its CPU time in a
generation), and that wait, not either side's work, decides the wall-clock ratio; one thread a side, CPU seconds
count the work. With `--generator vllm` the worker's CPU is another process's: no CPU rates then.
And the ratios hfmeg / TRL. The last line printed is one JSON object. With no arguments a small CPU run of a few
minutes.

    .venv/bin/python tools/bench_grpo.py --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT.parent / "shared" / "assets" / "models" / "stories260K"
PROMPTS = ["Once upon a time", "One day, a little girl named Lily", "Tom and his mom went to the", "The cat saw a big"]


def write_prompts(path: Path) -> Path:
    path.write_text("".join(json.dumps(dict(prompt=p)) + "\n" for p in PROMPTS))
    return path


def run_hfmeg(args, data: Path, out: Path) -> dict:
    sys.path.insert(0, str(ROOT / "recipes"))
    from hfmeg.data import DataConfig, SourceConfig
    from hfmeg.optim.config import OptimizerConfig
    from hfmeg.optim.lr_schedule import LRScheduleConfig
    from hfmeg.train.config import CheckpointArgs, LoopArgs, ModelArgs, TrainConfig
    from hfmeg.train.grpo import GRPOSettings
    from hfmeg.train.grpo_trainer import GRPOTrainer
    from hfmeg.train.metrics import read_metrics

    from hfmeg.generation.transformers_engine import TransformersEngine
    from hfmeg.train.rollout import Rollouts

    step_starts, gen_cpu = _cpu_timed(Rollouts, "__next__"), _cpu_timed(TransformersEngine, "generate", spent=True)
    cfg = TrainConfig(
        model=ModelArgs(path=str(args.model), dtype="fp32"),
        optim=OptimizerConfig(lr=args.lr, weight_decay=0.0),
        lr=LRScheduleConfig(warmup_steps=0, total_steps=args.steps, decay="constant"),
        data=DataConfig(sources=[SourceConfig(str(data))], seq_len=args.seq),
        grpo=GRPOSettings(reward_funcs=["grpo_toy_rewards:park"], num_generations=args.num_generations,
                          max_completion_length=args.max_completion_length, generator=args.generator),
        train=LoopArgs(micro_batch_size=args.batch, global_batch_size=args.batch, max_steps=args.steps),
        checkpoint=CheckpointArgs(out=str(out), save_every=0), report_to=[])
    GRPOTrainer(cfg).run()
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r][args.warmup:]
    tokens = sum(r["completions/mean_length"] * args.batch for r in rows)
    step_s = sum(args.batch * args.seq / r["tokens_per_s"] for r in rows)  # the loop's tokens_per_s: padded rows
    gen_s = sum(r["timing/generation_s"] for r in rows)
    push_s = sum(r["timing/weight_push_s"] for r in rows)
    cpu_steps = [b - a for a, b in zip(step_starts, step_starts[1:])][args.warmup:]  # steps 1..n-1: whole
    return dict(tokens=tokens, step_s=step_s, gen_s=gen_s, push_s=push_s, train_s=step_s - gen_s - push_s,
                reward=[r["reward"] for r in rows],
                **_cpu(rows_tokens=[r["completions/mean_length"] * args.batch for r in rows], steps=cpu_steps,
                       gen=gen_cpu[args.warmup:]) if args.generator == "transformers" else {})


def run_trl(args, data: Path, out: Path) -> dict:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    # The rank's one thread (`launch.spawn`), as hfmeg's side has: without OMP_NUM_THREADS accelerate's state sets
    # the physical cores here, which is unfair to hfmeg and, in a rank forked from a process that used OpenMP
    # threads (a test session), hangs the first parallel region (GNU OpenMP's pool does not survive fork).
    os.environ["OMP_NUM_THREADS"] = "1"
    sys.path.insert(0, str(ROOT / "recipes"))
    import torch
    from datasets import load_dataset
    from grpo_toy_rewards import park
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.pad_token or tok.eos_token
    config = GRPOConfig(output_dir=str(out), report_to="none", use_cpu=True, bf16=False, num_generations=args.num_generations,
                        per_device_train_batch_size=args.batch, max_completion_length=args.max_completion_length,
                        max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant", beta=0.0,
                        loss_type="dapo", temperature=1.0, logging_steps=1, save_strategy="no", seed=0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=[park], args=config, processing_class=tok,
                          train_dataset=load_dataset("json", data_files=str(data), split="train"))
    steps: list[dict] = []
    generate, training_step = trainer._generate, trainer.training_step

    def timed_generate(prompts):
        t0, c0 = time.perf_counter(), time.process_time()
        out = generate(prompts)
        steps[-1]["gen_s"] += time.perf_counter() - t0
        steps[-1]["gen_cpu_s"] += time.process_time() - c0
        steps[-1]["tokens"] += sum(len(c) for c in out[1])  # completion ids, one list per completion
        return out

    def timed_step(*a, **k):
        steps.append(dict(gen_s=0.0, gen_cpu_s=0.0, tokens=0))
        t0, c0 = time.perf_counter(), time.process_time()
        loss = training_step(*a, **k)
        steps[-1]["step_s"] = time.perf_counter() - t0
        steps[-1]["step_cpu_s"] = time.process_time() - c0
        return loss

    trainer._generate, trainer.training_step = timed_generate, timed_step
    trainer.train()
    rows = steps[args.warmup:]
    step_s, gen_s = sum(r["step_s"] for r in rows), sum(r["gen_s"] for r in rows)
    return dict(tokens=sum(r["tokens"] for r in rows), step_s=step_s, gen_s=gen_s, push_s=0.0,
                train_s=step_s - gen_s, **_cpu(rows_tokens=[r["tokens"] for r in rows],
                                                steps=[r["step_cpu_s"] for r in rows[:-1]],
                                                gen=[r["gen_cpu_s"] for r in rows]))


def _cpu_timed(cls, name: str, spent: bool = False) -> list[float]:
    """Wraps `cls.name` to record the process's CPU clock at each call's start (`spent`: the CPU each call took)."""
    real, record = getattr(cls, name), []

    def timed(self, *a, **k):
        c0 = time.process_time()
        if not spent:
            record.append(c0)
        out = real(self, *a, **k)
        if spent:
            record.append(time.process_time() - c0)
        return out

    setattr(cls, name, timed)
    return record


def _cpu(rows_tokens: list[float], steps: list[float], gen: list[float]) -> dict:
    """CPU rates over the measured steps but the last: tokens per CPU second of generation and of whole steps."""
    n = len(steps)
    return dict(cpu_step_s=sum(steps), gen_cpu_s=sum(gen[:n]), cpu_tokens=sum(rows_tokens[:n]))


def _rates(r: dict) -> dict:
    rates = dict(generation_tokens_per_s=r["tokens"] / r["gen_s"], training_tokens_per_s=r["tokens"] / r["train_s"],
                 end_to_end_tokens_per_s=r["tokens"] / r["step_s"])
    if r.get("cpu_step_s"):
        rates.update(generation_tokens_per_cpu_s=r["cpu_tokens"] / r["gen_cpu_s"],
                     end_to_end_tokens_per_cpu_s=r["cpu_tokens"] / r["cpu_step_s"])
    return rates


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=STORIES)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the rates (engine start, caches)")
    p.add_argument("--batch", type=int, default=16, help="completions a step")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--generator", choices=("transformers", "vllm"), default="transformers",
                   help="hfmeg's engine (TRL's is its transformers generate; with vllm the ratio is across engines)")
    p.add_argument("--sides", default="hfmeg,trl")
    args = p.parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"--model {args.model}: no config.json (the asset stories260K is absent?)", file=sys.stderr)
        sys.exit(2)
    if args.steps <= args.warmup:
        print(f"--steps {args.steps} must exceed --warmup {args.warmup}", file=sys.stderr)
        sys.exit(2)
    from hfmeg.parallel.launch import spawn

    result: dict = dict(model=str(args.model), steps=args.steps, warmup=args.warmup, batch=args.batch,
                        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
                        generator=args.generator, load=os.getloadavg()[0])
    with tempfile.TemporaryDirectory() as tmp:
        data = write_prompts(Path(tmp) / "prompts.jsonl")
        for side in args.sides.split(","):
            run = {"hfmeg": run_hfmeg, "trl": run_trl}[side]
            raw = spawn(run, 1, args, data, Path(tmp) / side, timeout_s=3600)[0]
            result[side] = {**raw, **_rates(raw)}
            print(side, {k: round(v, 1) for k, v in _rates(raw).items()}, flush=True)
    if "hfmeg" in result and "trl" in result:
        result["ratio"] = {k: result["hfmeg"][k] / result["trl"][k] for k in _rates(result["hfmeg"])
                           if k in result["trl"]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
