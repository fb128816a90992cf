"""Benchmark: pipeline bubble and activation memory of GPipe, 1F1B and interleaved 1F1B.

Runs a random LLaMA-shaped model (`--layers`, `--hidden`, ...) on TP x PP forked
gloo CPU processes, one training step per schedule after one warm-up step, and
reports per schedule:

- `bubble_measured`: per stage, (span of the whole step − time spent in forward
  and backward) / time spent in forward and backward, averaged over stages
  (communication waits count as bubble); against `bubble_theory` = (p−1)/m, or
  (p−1)/(v·m) for interleaved;
- `peak_activation_bytes`: per stage, the peak bytes of tensors autograd holds for
  backward (counted by `torch.autograd.graph.saved_tensors_hooks`, each storage
  once, parameters excluded), which is what the schedule's in-flight micro-batches
  cost.

Each result line is one JSON object; the last line compares with GPipe, the anchor
(ratios). The schedules' timelines go to one picture, `--out/pipeline_timeline.png`.
Needs at least as many CPU cores as processes (TP x PP), or busy time measures
contention: PP=2 on 2 cores, PP=4 on a 16-core machine.

    python tools/bench_pipeline.py --pp 2 --vpp 2 --microbatches 8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hfmeg.data.microbatch import MicroBatch
from hfmeg.families import model_config_from_hf
from hfmeg.errors import HfmegError
from hfmeg.models import ModelChunk
from hfmeg.parallel.activation_meter import SavedTensorMeter
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.layout import rank_chunks, split_layers
from hfmeg.parallel.pipeline import forward_backward
from hfmeg.parallel.schedules import validate
from hfmeg.parallel.state import ParallelConfig, ParallelState
from hfmeg.parallel.timeline import Timeline, bubble_fractions, draw


def _model_config(args):
    from transformers import LlamaConfig

    return model_config_from_hf(LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads, vocab_size=args.vocab,
        max_position_embeddings=args.seq))


def _worker(args, schedules):
    results = {}
    for schedule in schedules:
        vpp = args.vpp if schedule == "interleaved" else 1
        ps = ParallelState(ParallelConfig(tp=args.tp, pp=args.pp, vpp=vpp), dist.get_rank(), dist.get_world_size(),
                           torch.device("cpu"))
        cfg = _model_config(args)
        torch.manual_seed(0)
        chunks = [ModelChunk(cfg, ps, s.layers, pre_process=s.pre_process, post_process=s.post_process)
                  for s in rank_chunks(split_layers(cfg.num_layers, ps.pp, vpp), ps.pp_rank)]
        g = torch.Generator().manual_seed(0)
        mbs = [MicroBatch(input_ids=torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g),
                          labels=torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g))
               for _ in range(args.microbatches)]
        tokens = args.microbatches * args.micro_batch * args.seq
        for _ in range(args.warmup):
            forward_backward(chunks, ps, mbs, schedule=schedule, num_tokens=tokens)
        meter, timeline = SavedTensorMeter(chunks), Timeline(ps.pp_rank)
        dist.barrier()
        with meter.hooks():
            forward_backward(chunks, ps, mbs, schedule=schedule, num_tokens=tokens, timeline=timeline)
        results[schedule] = (timeline.events, meter.peak)
    return results if ps.tp_rank == 0 else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--vpp", type=int, default=2, help="virtual chunks per rank for the interleaved schedule")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--schedules", default="gpipe,1f1b,interleaved")
    ap.add_argument("--out", default="out", help="folder for the timeline PNGs")
    ap.add_argument("--oversubscribe", action="store_true", help="run even with fewer cores than processes")
    args = ap.parse_args(argv)
    schedules = args.schedules.split(",")
    world = args.tp * args.pp
    try:
        for s in schedules:
            validate(s, args.pp, args.vpp if s == "interleaved" else 1, args.microbatches)
        if (os.cpu_count() or 1) < world and not args.oversubscribe:
            raise HfmegError(f"{world} processes need at least {world} CPU cores, this machine has "
                             f"{os.cpu_count()} (--oversubscribe to run anyway)")
    except HfmegError as e:
        print(f"bench_pipeline: {e}", file=sys.stderr)
        return 2
    per_rank = [r for r in spawn(_worker, world, args, schedules, timeout_s=1800) if r is not None]
    rows, panels = [], []
    for s in schedules:
        vpp = args.vpp if s == "interleaved" else 1
        events = [e for r in per_rank for e in r[s][0]]
        bubbles = bubble_fractions(events)
        row = dict(schedule=s, pp=args.pp, vpp=vpp, tp=args.tp, microbatches=args.microbatches,
                   bubble_measured=round(sum(bubbles.values()) / len(bubbles), 4),
                   bubble_theory=round((args.pp - 1) / (vpp * args.microbatches), 4),
                   bubble_per_stage=[round(b, 4) for b in bubbles.values()],
                   peak_activation_bytes=[r[s][1] for r in per_rank],
                   step_ms=round((max(e.end for e in events) - min(e.start for e in events)) * 1e3, 1))
        panels.append((f"{s}: pp={args.pp} vpp={vpp} m={args.microbatches}  bubble measured "
                       f"{row['bubble_measured']:.3f} vs theory {row['bubble_theory']:.3f}", events))
        rows.append(row)
        print(json.dumps(row))
    png = draw(panels, Path(args.out) / "pipeline_timeline.png")
    print(f"{'schedule':<12} {'vpp':>3} {'bubble':>8} {'theory':>8} {'peak act MiB/stage':>24}", file=sys.stderr)
    for r in rows:
        mib = "/".join(f"{b / 2**20:.1f}" for b in r["peak_activation_bytes"])
        print(f"{r['schedule']:<12} {r['vpp']:>3} {r['bubble_measured']:>8.3f} {r['bubble_theory']:>8.3f} {mib:>24}",
              file=sys.stderr)
    anchor = next((r for r in rows if r["schedule"] == "gpipe"), rows[0])
    print(json.dumps(dict(
        anchor=anchor["schedule"], timeline_png=str(png), pp=args.pp, microbatches=args.microbatches,
        **{f"{r['schedule']}_peak_activation_ratio": round(max(r["peak_activation_bytes"])
                                                            / max(anchor["peak_activation_bytes"]), 3) for r in rows},
        **{f"{r['schedule']}_bubble_ratio": round(r["bubble_measured"] / max(anchor["bubble_measured"], 1e-9), 3)
           for r in rows})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
