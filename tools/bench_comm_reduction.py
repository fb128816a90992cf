"""Benchmark gradient-traffic reduction on gloo: PowerSGD on the sharded optimizer against torch's DDP hook.

One gloo world of `--dp` ranks trains a random LLaMA-shaped model (the same ids and sizes
as tools/bench_optimizer.py; parameters fp32, or bf16 with `--dtype bf16` as on GPUs)
with, in turn:

- `overlapped`: hfmeg's overlapped sharded optimizer, uncompressed (the anchor);
- `overlapped-shared`: the same during a shared-unlock warm start's shared phase (every
  layer uses layer 0's parameters, models/shared_layers.py): the layers are reduced and
  gathered once, so the traffic is the embedding, head and final norm plus 1/N of the layers;
- `powersgd-rK`: the same with `optim.compression: powersgd`, rank K;
- `ddp-powersgd-rK`: hfmeg's `ddp` mode (replicated optimizer state, so no parameter
  all-gather) with PowerSGD rank K;
- `torch-powersgd-rK`: torch `DistributedDataParallel` + `powerSGD_hook` at rank K
  (error feedback, warm start) and a replicated torch AdamW: the ecosystem's anchor.
  It runs with ONE bucket, so its communication starts after the whole backward: the
  hook issues its second all-reduce from the first one's completion callback, and with
  several buckets in flight gloo completes them on different threads in different
  orders on different ranks, so the ranks' collectives stop matching ("Received data
  size doesn't match expected size", seen here with small buckets). hfmeg issues
  every collective from the backward thread at points all ranks pass in the same
  order (parallel/powersgd.py), so it keeps its buckets.

Compression starts at step `--warmup` in every case (torch's hook needs
`start_powerSGD_iter` >= 2), and the timed steps come after, so all of them are
compressed. Step time is the median over the timed steps of the slowest rank.

Bytes per step and rank, two ways:
- `computed_bytes`: what each rank sends by the algorithms' arithmetic: a reduce-scatter
  or all-gather (DP-1)/DP of its buffer, an all-reduce 2 (DP-1)/DP (P, Q and exactly
  summed parts; torch's hook by its own rule: 2-D tensors with (m + n) k * rate < m n);
- `measured_bytes`: in a throttled run the ranks have a private loopback (`unshare -n`),
  so its transmitted-bytes counter over the timed steps, divided by steps and DP, is the
  traffic itself, TCP/IP headers and gloo's own messages included.

`--throttle RATE` works as in bench_optimizer.py (root + iproute2). Each case prints one
JSON line, then a table with ratios against the anchor, then one summary JSON line.

    .venv/bin/python tools/bench_comm_reduction.py --hidden 512 --layers 8 --seq 128 --throttle 1gbit
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from bench_args import at_least
from bench_optimizer import add_model_args, make_model, run_cli
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.models.shared_layers import share_layers
from hfmeg.optim import DistributedOptimizer, OptimizerConfig
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.state import ParallelConfig, ParallelState

MIN_RATE = 2.0  # min_compression_rate, hfmeg's and torch's default
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cases(ranks: list[int]) -> list[tuple[str, str, int]]:
    """(name, kind, rank) of every case, the anchor first."""
    out = [("overlapped", "overlapped", 0), ("overlapped-shared", "shared", 0)]
    for kind in ("powersgd", "ddp-powersgd", "torch-powersgd"):
        out += [(f"{kind}-r{k}", kind, k) for k in ranks]
    return out


def hfmeg_bytes(opt: DistributedOptimizer, dp: int) -> int:
    """Bytes one rank sends per step through hfmeg's collectives (see the module docstring): gradient sums in
    fp32 (the main grads, and P, Q), the parameter all-gather in the parameters' dtype."""
    dpx = opt.data_parallel
    sharded, part = opt.cfg.sharded, (dp - 1) / dp
    total = 0.0
    for b in opt.buckets:
        if dpx.compressor is not None and dpx.compressor.compresses(b):
            plan = dpx.compressor.plans[b.index]
            total += 4 * 2 * part * (plan.round1.numel() + plan.q.numel())
        else:
            total += 4 * (1 if sharded else 2) * part * b.size
        if sharded:  # the parameter all-gather
            total += b.param_buf.element_size() * part * b.size
    return round(total)


def torch_hook_bytes(model: torch.nn.Module, rank: int, dp: int) -> int:
    """Bytes one rank sends per step under DDP + powerSGD_hook (its compression rule, 2 (DP-1)/DP per all-reduce,
    in the gradients' dtype)."""
    elements = 0
    for p in model.parameters():
        m = p.shape[0]
        n = p.numel() // m
        k = min(rank, m, n)
        elements += (m + n) * k if p.dim() > 1 and (m + n) * k * MIN_RATE < m * n else p.numel()
    size = next(model.parameters()).element_size()
    return round(size * 2 * (dp - 1) / dp * elements)


def _loopback_tx() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[8])
    return 0


def _build(kind: str, k: int, folder: str, a, ps: ParallelState):
    """(model to call, optimizer-like with step(), computed bytes per step)."""
    chunk = load_chunks(HFCheckpoint(folder), ps, dtype=DTYPES[a.dtype])[0]
    if kind == "shared":
        share_layers(chunk)
    if kind == "torch-powersgd":
        one_bucket = sum(p.numel() * p.element_size() for p in chunk.parameters()) / 2**20 + 1
        model = torch.nn.parallel.DistributedDataParallel(chunk, bucket_cap_mb=one_bucket,
                                                          gradient_as_bucket_view=True)
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=k,
                                            start_powerSGD_iter=a.warmup, min_compression_rate=MIN_RATE)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        adamw = torch.optim.AdamW(chunk.parameters(), lr=1e-4, fused=True)
        return model, adamw, torch_hook_bytes(chunk, k, ps.dp)
    mode = "ddp" if kind == "ddp-powersgd" else "overlapped"
    cfg = OptimizerConfig(mode=mode, lr=1e-4, bucket_size=a.bucket_size, compression="none" if k == 0 else "powersgd",
                          powersgd_rank=max(k, 1), compression_start_step=a.warmup, min_compression_rate=MIN_RATE)
    opt = DistributedOptimizer([chunk], ps, cfg)
    return chunk, opt, hfmeg_bytes(opt, ps.dp)


def _run(kind: str, k: int, folder: str, a, ps: ParallelState) -> dict:
    model, opt, computed = _build(kind, k, folder, a, ps)
    g = torch.Generator().manual_seed(ps.rank)
    ids = torch.randint(0, a.vocab, (a.mbs, a.seq), generator=g)
    ends, tx = [], 0
    dist.barrier()
    start = time.perf_counter()
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            tx = _loopback_tx()
        (model(ids, labels=ids).sum() / (ids.numel() * ps.dp)).backward()
        opt.step()
        if isinstance(opt, DistributedOptimizer):
            if step == a.warmup + a.steps - 1:
                opt.wait_params()  # the last all-gathers belong to the timed steps
        else:
            opt.zero_grad(set_to_none=False)
        ends.append(time.perf_counter())
    tx = _loopback_tx() - tx
    times = torch.tensor([b - e for b, e in zip(ends, [start] + ends[:-1])][a.warmup:])
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {"step_s": statistics.median(times.tolist()), "computed_bytes": computed,
            "measured_bytes": round(tx / a.steps / ps.dp) if a.throttle else None}


def _worker(kind: str, k: int, folder: str, a) -> dict:
    ps = ParallelState(ParallelConfig(), dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    return _run(kind, k, folder, a, ps)


def run_all(a) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        n_params = make_model(Path(tmp), a)
        # A world per case: a process keeps every model the data-parallel wrapper has hooked (the
        # gradient hooks live in C++, out of reach of Python's cycle collector), so cases would pile up.
        rows = {name: spawn(_worker, a.dp, kind, k, tmp, a, timeout_s=3600)[0] for name, kind, k in cases(a.ranks)}
    anchor = rows["overlapped"]
    for name, row in rows.items():
        row.update(case=name, params=n_params, dp=a.dp, dtype=a.dtype, throttle=a.throttle,
                   step_vs_overlapped=row["step_s"] / anchor["step_s"],
                   bytes_vs_overlapped=row["computed_bytes"] / anchor["computed_bytes"])
        print(json.dumps(row), flush=True)
    print(f"\n{n_params / 1e6:.1f}M parameters ({a.dtype}), DP={a.dp}, link {a.throttle or 'unthrottled'}")
    print(f"{'case':<20} {'step s':>8} {'x anchor':>9} {'MB/step/rank':>13} {'x anchor':>9} {'measured MB':>12}")
    for name, row in rows.items():
        measured = f"{row['measured_bytes'] / 1e6:12.1f}" if row["measured_bytes"] is not None else f"{'-':>12}"
        print(f"{name:<20} {row['step_s']:8.3f} {row['step_vs_overlapped']:9.2f} {row['computed_bytes'] / 1e6:13.1f} "
              f"{row['bytes_vs_overlapped']:9.3f} {measured}")
    return {"params": n_params, "dp": a.dp, "dtype": a.dtype, "throttle": a.throttle, "cases": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--ranks", type=at_least(1), nargs="+", default=[1, 4, 8], help="PowerSGD ranks")
    p.add_argument("--steps", type=at_least(1), default=5)
    p.add_argument("--warmup", type=at_least(2), default=2, help="uncompressed steps first (untimed)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                   help="parameters (bf16: hfmeg keeps fp32 main grads and master weights; torch's DDP anchor "
                        "trains the bf16 parameters directly, its gradients and factors bf16)")
    return run_cli(p, argv, Path(__file__), run_all)


if __name__ == "__main__":
    sys.exit(main())
