"""LoRA vs full fine-tuning at the same layout: tokens/s, optimizer + gradient bytes, peak memory.

One gloo world per mode (so each mode's peak RSS is its own processes') trains a
random LLaMA-shaped model at `--tp` x `--pp` (DP fills the rest of `--world`) through
hfmeg's own path: the pipeline schedule and the overlapped distributed optimizer,
fp32 on CPU. `full` trains every weight; `lora` freezes the base and trains rank
`--r` adapters on every projection (`all-linear`), as `--peft lora` does. Reported
per mode: the median step time of the slowest rank, tokens/s, trainable parameters,
this rank's fp32 optimizer state and main-gradient bytes, and the peak RSS (max over
ranks). The last line printed is one JSON object; with no arguments it runs a small
CPU shape in a minute or so.

    .venv/bin/python tools/bench_peft.py --world 2 --tp 2 --hidden 512 --layers 4 --r 16
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from bench_args import at_least
from bench_optimizer import make_model

from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.optim import DistributedOptimizer, OptimizerConfig
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.pipeline import forward_backward
from hfmeg.parallel.state import ParallelConfig, ParallelState
from hfmeg.peft.adapters import attach, initialise
from hfmeg.peft.config import PeftConfig

MODES = ("full", "lora")


def _rank(mode: str, folder: str, a) -> dict:
    ps = ParallelState(ParallelConfig(tp=a.tp, pp=a.pp), dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    chunks = load_chunks(HFCheckpoint(folder), ps)
    if mode == "lora":
        cfg = PeftConfig(method="lora", r=a.r, alpha=2.0 * a.r, target_modules=["all-linear"])
        for chunk in chunks:
            attach(chunk, cfg)
            initialise(chunk, cfg, seed=0)
    opt = DistributedOptimizer(chunks, ps, OptimizerConfig(lr=1e-3))
    g = torch.Generator().manual_seed(ps.dp_rank)
    mbs = [dict(input_ids=(ids := torch.randint(0, a.vocab, (1, a.seq), generator=g)), labels=ids)
           for _ in range(a.microbatches)]
    ntok = a.seq * a.microbatches * ps.dp
    times = []
    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        forward_backward(chunks, ps, mbs, schedule="1f1b", num_tokens=ntok, grad_sync=opt)
        opt.step()
        opt.wait_params()
        times.append(time.perf_counter() - t0)
    timed = torch.tensor(times[a.warmup:])
    dist.all_reduce(timed, op=dist.ReduceOp.MAX)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0])  # Linux: KiB
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    step_s = statistics.median(timed.tolist())
    return dict(step_s=step_s, tokens_per_s=ntok / step_s, peak_rss_bytes=int(rss.item()),
                trainable_params=sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad),
                opt_state_bytes=opt.state_bytes(),
                main_grad_bytes=sum(gr.grad_buffer.numel() * gr.grad_buffer.element_size() for gr in opt.groups))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=at_least(1), default=2, help="gloo ranks")
    ap.add_argument("--tp", type=at_least(1), default=2)
    ap.add_argument("--pp", type=at_least(1), default=1)
    ap.add_argument("--hidden", type=at_least(64), default=256, help="multiple of 64 (64-wide heads)")
    ap.add_argument("--ffn", type=at_least(1), default=None)
    ap.add_argument("--layers", type=at_least(1), default=4)
    ap.add_argument("--vocab", type=at_least(2), default=2048)
    ap.add_argument("--seq", type=at_least(2), default=128)
    ap.add_argument("--microbatches", type=at_least(1), default=2, help="per DP rank and step")
    ap.add_argument("--r", type=at_least(1), default=16, help="LoRA rank")
    ap.add_argument("--steps", type=at_least(1), default=5)
    ap.add_argument("--warmup", type=at_least(0), default=1)
    a = ap.parse_args(argv)
    if a.world % (a.tp * a.pp) or a.hidden % 64 or (a.hidden // 64) % a.tp:
        ap.error("--tp x --pp must divide --world, and --tp the head count (--hidden / 64)")
    if a.layers < a.pp:
        ap.error("--layers must be >= --pp")
    with tempfile.TemporaryDirectory() as tmp:
        params = make_model(Path(tmp), a)
        rows = {mode: spawn(_rank, a.world, mode, tmp, a)[0] for mode in MODES}
    print(f"{'mode':6} {'step s':>8} {'tok/s':>9} {'trainable':>11} {'opt+grad MiB':>13} {'peak RSS MiB':>13}")
    for mode, r in rows.items():
        state = (r["opt_state_bytes"] + r["main_grad_bytes"]) / 2**20
        print(f"{mode:6} {r['step_s']:8.3f} {r['tokens_per_s']:9.0f} {r['trainable_params']:11,} {state:13.2f} "
              f"{r['peak_rss_bytes'] / 2**20:13.1f}")
    full, lora = rows["full"], rows["lora"]
    print(json.dumps(dict(world=a.world, tp=a.tp, pp=a.pp, hidden=a.hidden, layers=a.layers, seq=a.seq, r=a.r,
                          params=params, by_mode=rows,
                          lora_vs_full_tokens_per_s=lora["tokens_per_s"] / full["tokens_per_s"],
                          lora_vs_full_peak_rss=lora["peak_rss_bytes"] / full["peak_rss_bytes"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
