"""Context parallelism on gloo: activation memory per rank and tokens/s at CP 1, 2, 4 for one long row.

A tiny random LLaMA (GQA: 8 query heads over 2 KV heads) runs forward and backward
on one row of `--seq` tokens, split over CP ranks by `parallel.context` (each rank
its 2 chunks of the load-balanced split, attention over the all-gathered K/V). Per CP
size: the bytes autograd saves on a rank (the saved-tensor meter's peak), the
planner's prediction of them (`plan.activations.chunk_bytes`, with the CPU path's
dense mask), the ratio N x (CP = N) / (CP = 1) (1.0 would be a perfect split), and
tokens/s of the row over the CP group (the median of `--steps` timed steps after
one warm-up). One JSON line per CP size, a table, then a JSON summary as the last line.
Timings on a shared CPU host are indicative only; the memory figures are exact.

    .venv/bin/python tools/bench_cp.py [--seq 4096] [--cp 1 2 4] [--layers 4] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig

from hfmeg.data.microbatch import MicroBatch
from hfmeg.families import model_config_from_hf
from hfmeg.models.decoder import ModelChunk
from hfmeg.parallel.activation_meter import SavedTensorMeter
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.state import ParallelConfig, ParallelState
from hfmeg.plan.activations import Shape, chunk_bytes
from bench_args import at_least


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=at_least(2), default=4096, help="tokens in the row")
    p.add_argument("--cp", type=at_least(1), nargs="+", default=[1, 2, 4], help="CP sizes (gloo ranks each)")
    p.add_argument("--layers", type=at_least(1), default=4)
    p.add_argument("--hidden", type=at_least(8), default=256)
    p.add_argument("--steps", type=at_least(1), default=3, help="timed forward+backward steps per CP size")
    a = p.parse_args(argv)
    for cp in a.cp:
        if a.seq % (2 * cp):
            p.error(f"--seq {a.seq} does not split into 2 x CP = {2 * cp} equal chunks (--cp {cp})")
    if a.hidden % 8:
        p.error(f"--hidden {a.hidden} must be a multiple of the 8 attention heads")
    return a


def hf_config(a) -> LlamaConfig:
    return LlamaConfig(hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=a.layers,
                       num_attention_heads=8, num_key_value_heads=2, vocab_size=256, max_position_embeddings=a.seq)


def _rank(a, cp: int) -> dict:
    ps = ParallelState(ParallelConfig(cp=cp), dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    torch.manual_seed(0)
    chunk = ModelChunk(model_config_from_hf(hf_config(a)), ps, range(a.layers), pre_process=True,
                       post_process=True)
    ids = torch.randint(0, 256, (1, a.seq), generator=torch.Generator().manual_seed(1))
    mb = MicroBatch(input_ids=ids, labels=ids).shard(ps.cp_rank, ps.cp)
    meter = SavedTensorMeter([chunk])
    with meter.hooks():
        loss = chunk(mb.input_ids, position_ids=mb.position_ids, labels=mb.labels).sum()
    saved = meter.peak
    loss.backward()
    seconds = []
    for step in range(a.steps + 1):  # the first is a warm-up
        dist.barrier()
        t0 = time.perf_counter()
        chunk(mb.input_ids, position_ids=mb.position_ids, labels=mb.labels).sum().backward()
        dist.barrier()
        if step:
            seconds.append(time.perf_counter() - t0)
    return dict(saved=saved, step_s=statistics.median(seconds))


def main(argv=None) -> dict:
    a = parse_args(argv)
    cfg = model_config_from_hf(hf_config(a))
    rows = []
    for cp in a.cp:
        ranks = spawn(_rank, cp, a, cp, timeout_s=3600)
        saved = max(r["saved"] for r in ranks)
        step_s = max(r["step_s"] for r in ranks)
        predicted = chunk_bytes(cfg, Shape(1, a.seq, 1, False, 4, "none", cp=cp, dense_mask=cp > 1),
                                range(a.layers), True, True)
        rows.append(dict(cp=cp, seq=a.seq, activation_bytes_per_rank=saved, predicted_bytes=predicted,
                         prediction_error=(predicted - saved) / saved, tokens_per_s=a.seq / step_s, step_s=step_s))
    base = next((r for r in rows if r["cp"] == 1), None)
    for r in rows:
        r["split_ratio"] = r["cp"] * r["activation_bytes_per_rank"] / base["activation_bytes_per_rank"] \
            if base else None
        print(json.dumps(r))
    print(f"tiny LLaMA (hidden {a.hidden}, {a.layers} layers, 8 heads / 2 KV heads), one row of {a.seq} tokens, "
          "fp32, gloo")
    print(f"{'CP':>3}{'MiB/rank':>10}{'predicted':>11}{'N x ratio':>11}{'tokens/s':>10}")
    for r in rows:
        ratio = f"{r['split_ratio']:.3f}" if r["split_ratio"] is not None else "-"
        print(f"{r['cp']:>3}{r['activation_bytes_per_rank'] / 2**20:>10.2f}{r['predicted_bytes'] / 2**20:>11.2f}"
              f"{ratio:>11}{r['tokens_per_s']:>10.0f}")
    summary = dict(seq=a.seq, layers=a.layers, hidden=a.hidden, rows=rows,
                   worst_prediction_error=max(abs(r["prediction_error"]) for r in rows),
                   worst_split_ratio=max((r["split_ratio"] for r in rows if r["split_ratio"] is not None),
                                         default=None))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
