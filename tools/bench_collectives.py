"""Benchmark the sharded optimizer's per-bucket pieces against what they replace.

On one gloo world of `--dp` ranks, for one flat fp32 buffer of `--numel` elements:

- communication: the native `all_reduce` (DDP's collective, the anchor), the native
  reduce-scatter and all-gather, and hfmeg's `reduce_scatter_async` /
  `all_gather_async` (hfmeg/parallel/bucket_comm.py: all-to-all + local sum, and one
  isend/irecv per peer, on gloo). Median of `--reps` over the slowest rank;
- the update: torch AdamW, foreach vs fused, on one rank's shard (`numel / dp`
  elements), one thread, as each rank runs it.

`--throttle RATE` runs the ranks in a private network namespace with a rate-limited
loopback, as in bench_optimizer.py. The last line printed is one JSON object.

    .venv/bin/python tools/bench_collectives.py --numel 57700000 --throttle 4gbit
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench_optimizer import parse_throttled, timed
from hfmeg.parallel.bucket_comm import ScratchPool, all_gather_async, reduce_scatter_async
from hfmeg.parallel.comm import all_gather_flat, reduce_scatter_flat
from hfmeg.parallel.launch import spawn


def _adamw_s(numel: int, impl: str, reps: int) -> float:
    """Best-of-`reps` seconds for one AdamW step over `numel` fp32 elements in 6 tensors."""
    params = [torch.zeros(n, requires_grad=True) for n in [numel // 6] * 5 + [numel - 5 * (numel // 6)]]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, fused=impl == "fused", foreach=impl == "foreach")
    opt.step()  # allocates the moments
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return min(times)


def _worker(a) -> dict[str, float]:
    group, dp = dist.group.WORLD, dist.get_world_size()
    numel = a.numel // dp * dp
    full, out = torch.ones(numel), torch.empty(numel)
    shard = torch.ones(numel // dp)
    pool = ScratchPool(numel)
    res = {
        "all_reduce": timed(lambda: dist.all_reduce(full), a.reps),
        "native_reduce_scatter": timed(lambda: reduce_scatter_flat(shard, full), a.reps),
        "native_all_gather": timed(lambda: all_gather_flat(out, shard), a.reps),
        "hfmeg_reduce_scatter": timed(lambda: reduce_scatter_async(shard, full, group, pool).wait(), a.reps),
        "hfmeg_all_gather": timed(lambda: all_gather_async(out, shard, group, tag=0).wait(), a.reps),
    }
    if dist.get_rank() == 0:
        res.update({f"adamw_{impl}_s": _adamw_s(numel // dp, impl, a.reps) for impl in ("foreach", "fused")})
    return res, _agrees(numel, dp, group, pool)


def _agrees(numel: int, dp: int, group, pool) -> bool:
    """Whether hfmeg's reduce-scatter and all-gather give the native ones' results on distinct per-rank data
    (integers, so sums are exact in any order): a fast piece that computed something else would time nothing."""
    full = torch.arange(numel, dtype=torch.float32) + 1000 * dist.get_rank()
    want, got = torch.empty(numel // dp), torch.empty(numel // dp)
    reduce_scatter_flat(want, full.clone())
    reduce_scatter_async(got, full.clone(), group, pool).wait()
    gathered_want, gathered_got = torch.empty(numel), torch.empty(numel)
    all_gather_flat(gathered_want, want)
    all_gather_async(gathered_got, got, group, tag=1).wait()
    return torch.equal(want, got) and torch.equal(gathered_want, gathered_got)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--numel", type=int, default=57_700_000)
    p.add_argument("--reps", type=int, default=4)
    a, rc = parse_throttled(p, argv, Path(__file__))
    if rc is not None:
        return rc
    ranks = spawn(_worker, a.dp, a, timeout_s=1800)
    res = ranks[0][0]
    for name, s in res.items():
        print(f"{name:<24} {s:.3f} s", flush=True)
    agree = all(ok for _, ok in ranks)
    print(f"hfmeg's collectives give the native results on every rank: {agree}", flush=True)
    print(json.dumps({"dp": a.dp, "numel": a.numel, "throttle": a.throttle, **res, "hfmeg_matches_native": agree}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
