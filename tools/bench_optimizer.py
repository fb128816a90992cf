"""Benchmark the optimizer modes against torch DistributedDataParallel on gloo.

For each gradient-accumulation setting, one gloo world of `--dp` ranks trains a
random LLaMA-shaped model with, in turn:

- `compute`: forward/backward + a local AdamW step, no communication at all (the
  floor used to define exposed communication);
- `ddp`: torch `DistributedDataParallel` (bucketed all-reduce overlapped with
  backward, `no_sync` on all but the last micro-batch) + replicated `torch.optim.AdamW`;
- hfmeg `distributed` (reduce-scatter / all-gather in series with compute) and
  `overlapped` (the default).

Steps run back to back; step time is the median over the timed steps (max over
ranks; the mean is reported too), and `cpu_per_step_s` the user + system CPU time
per timed step of the busiest rank (all its threads: on a machine with a core per
rank, a step can be no faster than that). Exposed communication = step time - compute-only step time: the
time the step spends on collectives that compute did not hide.

To separate the network from CPU contention, each world also times the
communication alone, with no compute (`comm_only_s`): DDP's bucketed all-reduce of
the gradients, and the sharded modes' gradient reduce-scatter + parameter
all-gather of the same buckets (hfmeg's own `GradSync` / `publish_params` path).
Overlap can at best hide min(comm, compute); on a 2-core machine the gloo threads
also compete with compute for the cores, which the `compute` and `comm_only`
rows next to the mode rows make visible.

`--throttle RATE` (e.g. `2gbit`) re-runs this script inside a private network
namespace (`unshare -n`) whose loopback is rate-limited with a `tc` token-bucket filter (`tbf`);
this needs root and iproute2 (`apt-get install -y iproute2`) and is skipped with a
message otherwise. The last line printed is one JSON object.

    .venv/bin/python tools/bench_optimizer.py --dp 2 --hidden 512 --layers 8 --throttle 1gbit
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from bench_args import at_least

from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.optim import DistributedOptimizer, OptimizerConfig, no_weight_decay
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.roles import named_roles
from hfmeg.parallel.state import ParallelConfig, ParallelState

IMPLS = ("compute", "ddp", "distributed", "overlapped")


def make_model(folder: Path, a, dtype: torch.dtype = torch.float32) -> int:
    """A random LLaMA of `a`'s shape saved in `dtype` to `folder`; its parameter count."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=a.ffn or (a.hidden * 8 // 3 // 64) * 64,
                      num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64,
                      num_key_value_heads=a.hidden // 64, vocab_size=a.vocab, max_position_embeddings=a.seq)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _adamw(chunk, opt_cfg):
    """The anchors' replicated torch AdamW, the same implementation the sharded modes use."""
    roles = named_roles(chunk)
    groups = [{"params": [p for _, p, r in roles if not no_weight_decay(r, opt_cfg)]},
              {"params": [p for _, p, r in roles if no_weight_decay(r, opt_cfg)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=opt_cfg.lr, weight_decay=opt_cfg.weight_decay,
                             fused=opt_cfg.impl == "fused", foreach=opt_cfg.impl == "foreach")


def _cpu_s() -> float:
    """User + system CPU seconds of this process so far (all its threads, gloo's included)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _run(impl, folder, a, ga, ps):
    """Median and mean seconds per step for `impl`, CPU seconds per step (the busiest rank), and
    the optimizer-state bytes of this rank."""
    chunk = load_chunks(HFCheckpoint(folder), ps)[0]
    opt_cfg = OptimizerConfig(mode=impl if impl in ("distributed", "overlapped") else "ddp",
                              bucket_size=a.bucket_size, impl=a.adamw)
    g = torch.Generator().manual_seed(ps.rank)
    ids = torch.randint(0, a.vocab, (a.mbs, a.seq), generator=g)
    ntok = ids.numel() * ga * ps.dp
    model, opt, state_bytes = chunk, None, 0
    if impl in ("distributed", "overlapped"):
        opt = DistributedOptimizer([chunk], ps, opt_cfg)
        state_bytes = opt.state_bytes()
    else:
        if impl == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(chunk, bucket_cap_mb=a.bucket_size * 4 / 2**20,
                                                              gradient_as_bucket_view=True)
        adamw = _adamw(chunk, opt_cfg)
        state_bytes = 3 * 4 * sum(p.numel() for p in chunk.parameters())  # master (the params) + m + v
    # Steps run back to back (no barrier between them, which could absorb in-flight all-gathers
    # outside the timed region); each step's time runs from the previous step's end, and after
    # the last step `overlapped` waits for its all-gathers, so nothing is left uncounted.
    ends = []
    dist.barrier()
    start, cpu = time.perf_counter(), [_cpu_s()]
    for step in range(a.warmup + a.steps):
        for m in range(ga):
            last = m == ga - 1
            if opt is not None:
                opt.set_last_microbatch(0, last)
            with model.no_sync() if impl == "ddp" and not last else contextlib.nullcontext():
                (model(ids, labels=ids).sum() / ntok).backward()
        if opt is not None:
            opt.step()
            if step == a.warmup + a.steps - 1:
                opt.wait_params()
        else:
            torch.nn.utils.clip_grad_norm_(chunk.parameters(), opt_cfg.grad_clip)
            adamw.step()
            adamw.zero_grad(set_to_none=False)
        ends.append(time.perf_counter())
        cpu.append(_cpu_s())
    steps = torch.tensor([b - e for b, e in zip(ends, [start] + ends[:-1])][a.warmup:] +
                         [(cpu[-1] - cpu[a.warmup]) / a.steps])
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    times, cpu_per_step = steps[:-1].tolist(), steps[-1].item()
    return statistics.median(times), statistics.mean(times), cpu_per_step, state_bytes


def timed(fn, reps: int) -> float:
    """Median over `reps` of the slowest rank's time for `fn()`."""
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return statistics.median(times)


def _comm_only(folder, a, ps) -> dict[str, float]:
    """Seconds for one step's communication with no compute: DDP all-reduce vs sharded RS + AG."""
    opt = DistributedOptimizer([load_chunks(HFCheckpoint(folder), ps)[0]], ps,
                               OptimizerConfig(mode="distributed", bucket_size=a.bucket_size))
    sync = opt.data_parallel.grad_sync

    def allreduce():
        for h in [dist.all_reduce(b.grad_buf, async_op=True) for b in opt.buckets]:
            h.wait()

    def sharded():
        sync.finish()  # launches every bucket's reduce-scatter, then waits
        opt.publish_params()  # all-gathers (waited in `distributed` mode)
        sync.reset()

    return {"allreduce": timed(allreduce, a.steps), "sharded": timed(sharded, a.steps)}


def _worker(folder, a, ga, comm):
    ps = ParallelState(ParallelConfig(), dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    out = {impl: _run(impl, folder, a, ga, ps) for impl in a.impls}
    return out, _comm_only(folder, a, ps) if comm else None


def run_all(a) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        n_params = make_model(Path(tmp), a)
        by_ga, comm = {}, None
        for ga in a.ga:
            res, c = spawn(_worker, a.dp, tmp, a, ga, comm is None, timeout_s=3600)[0]
            if c is not None:
                comm = c
                print(f"comm only: DDP all-reduce {c['allreduce']:.3f}s  sharded RS+AG {c['sharded']:.3f}s", flush=True)
            by_ga[ga] = {impl: {"step_s": med, "mean_step_s": mean, "cpu_per_step_s": cpu, "state_bytes": b}
                         for impl, (med, mean, cpu, b) in res.items()}
            base = by_ga[ga].get("compute", {}).get("step_s")
            for impl, row in by_ga[ga].items():
                row["exposed_comm_s"] = row["step_s"] - base if base is not None else float("nan")
                print(f"GA={ga:<2} {impl:<12} step median {row['step_s']:.3f}s mean {row['mean_step_s']:.3f}s  "
                      f"cpu/step {row['cpu_per_step_s']:.3f}s  exposed comm {row['exposed_comm_s']:.3f}s  opt state/rank "
                      f"{row['state_bytes'] / 2**20:.1f} MiB", flush=True)
    first = by_ga[a.ga[0]]
    step = lambda impl: first[impl]["step_s"] if impl in first else None  # noqa: E731
    ratio = lambda x, y: step(x) / step(y) if step(x) and step(y) else None  # noqa: E731
    state = lambda impl: first[impl]["state_bytes"] if impl in first else None  # noqa: E731
    return {"params": n_params, "dp": a.dp, "throttle": a.throttle, "ga": a.ga[0],
            "ddp_step_s": step("ddp"), "distributed_step_s": step("distributed"),
            "overlapped_step_s": step("overlapped"),
            "overlapped_vs_distributed": ratio("overlapped", "distributed"),
            "overlapped_vs_ddp": ratio("overlapped", "ddp"),
            "opt_state_bytes_per_rank": state("overlapped"), "ddp_opt_state_bytes_per_rank": state("ddp"),
            "comm_only_s": comm, "by_ga": {str(k): v for k, v in by_ga.items()}}


def parse_throttled(p: argparse.ArgumentParser, argv: list[str] | None, script: Path):
    """Parse `argv` with `--throttle RATE` added to `p`. Returns (args, None) to run here, with
    `args.throttle` the loopback rate in force (None: unthrottled), or (args, exit code) once
    `script` has been re-run inside a throttled namespace."""
    p.add_argument("--throttle", default="", help="loopback rate, e.g. 4gbit (needs root + tc)")
    p.add_argument("--inner-throttle", default="", dest="inner_throttle", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    if a.throttle:
        return a, throttled(script, a.throttle, argv)
    a.throttle = a.inner_throttle or None
    return a, None


def throttled(script: Path, rate: str, argv: list[str]) -> int:
    """Re-run `script` with `argv` in a private network namespace whose loopback runs at `rate`.

    The script gets `--inner-throttle RATE` in place of `--throttle RATE`, to report the rate."""
    missing = [t for t in ("unshare", "ip", "tc") if shutil.which(t) is None]
    if missing:
        print(f"throttled mode skipped: {', '.join(missing)} not found (apt-get install -y iproute2 util-linux)",
              file=sys.stderr)
        return 0
    inner, skip = [], False
    for arg in argv:  # drop `--throttle RATE` / `--throttle=RATE`
        if not skip and not arg.startswith("--throttle"):
            inner.append(arg)
        skip = arg == "--throttle"
    shell = (f"ip link set lo up && tc qdisc add dev lo root tbf rate {rate} burst 256kb latency 50ms && "
             f"exec {sys.executable} {script.resolve()} {' '.join(inner)} --inner-throttle {rate}")
    proc = subprocess.run(["unshare", "-n", "sh", "-c", shell])
    if proc.returncode != 0:
        print("throttled run failed (`unshare -n` + `tc` need root / CAP_NET_ADMIN; see the error above)",
              file=sys.stderr)
    return proc.returncode


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The world, model-shape and bucket flags of the data-parallel benchmarks (`make_model` reads them)."""
    p.add_argument("--dp", type=at_least(2), default=2)
    p.add_argument("--hidden", type=at_least(64), default=768)
    p.add_argument("--ffn", type=at_least(0), default=0, help="default: 8/3 hidden rounded to 64")
    p.add_argument("--layers", type=at_least(1), default=12)
    p.add_argument("--vocab", type=at_least(2), default=32000)
    p.add_argument("--seq", type=at_least(2), default=256)
    p.add_argument("--mbs", type=at_least(1), default=1)
    p.add_argument("--bucket-size", type=at_least(1), default=5_000_000, dest="bucket_size")


def run_cli(p: argparse.ArgumentParser, argv: list[str] | None, script: Path, run) -> int:
    """Parse `argv` (with `--throttle`), then print `run(args)` as the last JSON line, here or throttled."""
    a, rc = parse_throttled(p, argv, script)
    if rc is not None:
        return rc
    print(json.dumps(run(a)))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--ga", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--adamw", default="fused", choices=("fused", "foreach"),
                   help="torch AdamW implementation, for every row alike")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    return run_cli(p, argv, Path(__file__), run_all)


if __name__ == "__main__":
    sys.exit(main())
