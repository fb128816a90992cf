"""`hfmeg plan calibrate`: measure a `Profile` on the machine at hand.

- matmul efficiency vs size: square matmuls from 64 to `max_n`, median of repeats,
  as a fraction of the reference peak (the GPU's datasheet peak; on a CPU, the
  best rate measured, since a CPU has no single published peak);
- attention: causal SDPA forward + backward, on the causal half of Megatron's FLOPs (head dim
  128 on GPUs);
- streaming bandwidth (a large copy), and the fixed costs of one decoder layer's
  forward + backward, of the embedding + LM head + loss, and of one gradient
  bucket in the optimizer step, at sizes where compute is negligible; an MoE
  layer's the same way, with 2 and with 8 experts (each expert runs, tokens or
  not, so its cost is linear in the experts: the line through the two); and what
  selective and full recompute add to a layer's, as fractions of its fixed cost
  (re-running a forward under checkpointing costs more than the forward did);
  and what the pipeline executor adds per micro-batch and the whole step (loss,
  schedule, hooks, the optimizer's call, the loss's and norm's all-reduces) around
  the chunk's own forward + backward: a tiny model's step with 1 and with 4
  micro-batches against its bare forward + backward;
- collectives on the CPU, with 2, 4, 8, ... forked gloo ranks on the host (up to
  four per core), in pairs that all work at once: the all-reduce bus bandwidth of
  a large tensor, and the latency of a message as a training step pays it: the
  tiny layers' forward + backward at TP 2 against TP 1 on the same ranks, the
  difference over the TP all-reduces' messages. Between autograd kernels a gloo
  message costs several times what a tight all-reduce loop shows (each collective
  hands off between the rank's threads, and each wake-up waits for a core), and
  once ranks outnumber the cores it waits for its receiver to be scheduled, so
  the link depends on how many ranks share the host. The same TP 1 runs give how
  much slower a rank computes with that many ranks on the host than alone: ranks
  beyond the cores take turns, and even one rank per core runs Python and autograd
  slower when every core is busy (measured on the 2-core VM this was written on).
  One GPU cannot measure NCCL, so GPU profiles keep the cluster's links at the
  default efficiency.

CPU ranks run one intra-op thread each (as `launch.spawn` workers do), so the CPU
profile is per rank, and `cores` records how many ranks can compute at once. A
trainer's `--layout auto` on CPU ranks measures a quick in-job subset (`in_job`).
"""

from __future__ import annotations

import os
import statistics
import time


import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data.microbatch import MicroBatch
from ..families import model_config_from_hf
from ..models.decoder import ModelChunk
from ..optim import DistributedOptimizer, OptimizerConfig
from ..parallel.grid import RankGrid
from ..parallel.launch import spawn
from ..parallel.pipeline import forward_backward
from ..parallel.state import ParallelConfig, ParallelState
from .profile import Profile


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _matmul_rates(device, dtype, max_n: int, repeats: int) -> list[tuple[float, float]]:
    out, n = [], 64
    while n <= max_n:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        flops = 2.0 * n ** 3
        out.append((flops, flops / _timed(lambda: a @ b, device, repeats)))
        n *= 2
    return out


def _attention_rate(device, dtype, seq: int, heads: int, head_dim: int, repeats: int) -> float:
    q, k, v = (torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    causal_flops = 3 * 2.0 * seq * seq * heads * head_dim  # forward 2·s²·h·d (causal half), backward twice that
    return causal_flops / _timed(step, device, repeats)


def _bandwidth(device, repeats: int) -> float:
    big = torch.empty(16 * 2**20, dtype=torch.float32, device=device)
    dst = torch.empty_like(big)
    return 2 * big.numel() * 4 / _timed(lambda: dst.copy_(big), device, repeats)


def _timed_in_turns(runs: dict, rounds: int, device: torch.device) -> dict:
    """Median seconds of each of `runs`' functions, called in turn, round after round (one more
    round first, to warm up), so that a drift of the machine's speed moves them all alike."""
    times = {k: [] for k in runs}
    for _ in range(rounds + 1):
        for k, fn in runs.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v[1:]) for k, v in times.items()}


LAYERS = 4


def _tiny_chunk(ps, device, ends: bool = False, experts: int = 0, recompute: str = "none") -> ModelChunk:
    """Four decoder layers (and with `ends` the embedding and LM head + loss; with `experts`, MoE layers
    routing each token to two of them) so small that their compute is negligible: what is left is fixed cost."""
    # Imported here: a model's config module pulls in transformers' loading machinery (torch.distributed.tensor,
    # sympy, accelerate), which a trainer that only imports this module (through auto_layout) should not pay.
    from transformers import LlamaConfig, MixtralConfig

    dims = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                vocab_size=128, max_position_embeddings=16)
    hf = MixtralConfig(**dims, num_key_value_heads=4, num_local_experts=experts, num_experts_per_tok=2) \
        if experts else LlamaConfig(**dims)
    cfg = model_config_from_hf(hf)
    chunk = ModelChunk(cfg, ps, range(LAYERS), pre_process=ends, post_process=ends, recompute=recompute).to(device)
    with torch.no_grad():
        for p in chunk.parameters():
            p.normal_(0.0, 0.02)
    return chunk


_TINY_PS = RankGrid().place(0)


def _fixed_costs(device, repeats: int) -> tuple[float, float, float, float, float, float]:
    """(a layer's fixed cost, the ends', an MoE layer's beside its experts', an expert's, and what selective
    and full recompute add, as fractions of a layer's), from tiny chunks timed in turns, round after round,
    so that a drift of the machine's speed moves them all alike instead of skewing their differences."""
    x = torch.randn(8, 1, 32, device=device, requires_grad=True)
    ids = torch.randint(0, 128, (1, 8), device=device)

    def layers(**kw):
        chunk = _tiny_chunk(_TINY_PS, device, **kw)
        return lambda: chunk(x, seq_len=8).sum().backward()

    whole = _tiny_chunk(_TINY_PS, device, ends=True)
    runs = {"none": layers(), "selective": layers(recompute="selective"), "full": layers(recompute="full"),
            "two": layers(experts=2), "eight": layers(experts=8),
            "ends": lambda: whole(ids, labels=ids).sum().backward()}
    times = _timed_in_turns(runs, 4 * repeats, device)
    t = {k: v / (1 if k == "ends" else LAYERS) for k, v in times.items()}
    expert = max(t["eight"] - t["two"], 0.0) / 6  # every expert runs, tokens or not: a line in the experts
    return (t["none"], max(t["ends"] - LAYERS * t["none"], 0.0), max(t["two"] - 2 * expert, 0.0), expert,
            max(t["selective"] - t["none"], 0.0) / t["none"], max(t["full"] - t["none"], 0.0) / t["none"])


def _bucket_overhead(device_type: str, repeats: int) -> float:
    """Optimizer step time per bucket: the same chunk cut into many small buckets vs one bucket."""
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    ps = ParallelState(ParallelConfig(), 0, 1, device)
    per = []
    for bucket_size in (10**9, 300):
        chunk = _tiny_chunk(ps, device)
        opt = DistributedOptimizer([chunk], ps, OptimizerConfig(bucket_size=bucket_size))
        per.append((len(opt.buckets), _timed(opt.step, device, repeats)))
    (n1, t1), (n2, t2) = per
    return max(t2 - t1, 0.0) / (n2 - n1)


def _mean_time(fn, repeats: int) -> float:
    """Mean seconds of `fn` after one warm-up call: with more ranks than cores the scheduler's time slices
    land on some calls only, and a median would skip them."""
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


# TP all-reduces per decoder layer, forward + backward (attention and MLP outputs; their inputs' gradients),
# and messages per all-reduce of two ranks (the own half out, the partner's sum back)
_TP_ALL_REDUCES, _PAIR_MESSAGES = 4, 2


def _gloo_pair_link(nbytes: int, repeats: int) -> tuple[float, float, float, float]:
    """(bus bytes/s, message latency, seconds of the tiny layers at TP 1, the TP collectives' cost with
    sequence parallelism over without) of this rank's TP pair, (2i, 2i+1), while every pair works at once."""
    cpu = torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    step = {}
    for tp, sp in ((1, False), (2, False), (2, True)):
        chunk = _tiny_chunk(ParallelState(ParallelConfig(tp=tp, sequence_parallel=sp), rank, world, cpu), cpu)
        x = torch.randn(8 // tp if sp else 8, 1, 32, requires_grad=True)
        dist.barrier()
        step[tp, sp] = _mean_time(lambda: chunk(x, seq_len=8).sum().backward(), 10 * repeats)
    tp_comm = max(step[2, False] - step[1, False], 1e-9)
    latency = tp_comm / (LAYERS * _TP_ALL_REDUCES * _PAIR_MESSAGES)
    pair = ParallelState(ParallelConfig(tp=2), rank, world, cpu).tp_group
    big = torch.ones(nbytes // 4)
    dist.barrier()
    seconds = _mean_time(lambda: dist.all_reduce(big, group=pair), repeats)
    return (nbytes / max(seconds - _PAIR_MESSAGES * latency, 1e-9), latency, step[1, False],
            max(step[2, True] - step[1, False], 0.0) / tp_comm)


def _gloo_links(cores: int, nbytes: int, repeats: int) -> tuple[tuple[tuple[int, float, float], ...],
                                                                 tuple[tuple[int, float], ...], float]:
    """((ranks, bytes/s, latency), (ranks, slowdown), SP's cost over TP's) for 2, 4, 8, ... ranks up to
    four per core (at least 8), the median rank's; the slowdown is against the same tiny layers run here,
    alone; SP's factor is the 2-rank one (with more ranks than cores the waits blur it)."""
    chunk = _tiny_chunk(_TINY_PS, torch.device("cpu"))
    x = torch.randn(8, 1, 32, requires_grad=True)
    alone = _mean_time(lambda: chunk(x, seq_len=8).sum().backward(), 10 * repeats)
    links, slowdown, sp, ranks = [], [], [], 2
    while ranks <= max(8, 4 * cores):
        bws, lats, steps, sps = zip(*spawn(_gloo_pair_link, ranks, nbytes, repeats))
        links.append((ranks, statistics.median(bws), statistics.median(lats)))
        slowdown.append((ranks, max(statistics.median(steps) / alone, 1.0)))
        sp.append(statistics.median(sps))
        ranks *= 2
    return tuple(links), tuple(slowdown), sp[0]


def _executor_overheads(device_type: str, repeats: int) -> tuple[float, float]:
    """(per micro-batch, per step) seconds the executor and the step add to the tiny model's own forward +
    backward, from steps of 1 and 4 micro-batches and the bare forward + backward, timed in turns."""
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    ps = ParallelState(ParallelConfig(), 0, 1, device)
    chunk = _tiny_chunk(ps, device, ends=True)
    opt = DistributedOptimizer([chunk], ps, OptimizerConfig(bucket_size=10**9))
    ids = torch.randint(0, 128, (1, 8), device=device)
    mbs = [MicroBatch(input_ids=ids, labels=ids)] * 4

    def step(m: int) -> None:
        forward_backward([chunk], ps, mbs[:m], schedule="1f1b", num_tokens=8 * m, grad_sync=opt)
        opt.step()
        opt.wait_params()
        dist.barrier()

    alone = _tiny_chunk(ps, device, ends=True)  # the same model without the optimizer's hooks
    runs = {"bare": lambda: alone(ids, labels=ids).sum().backward(), 1: lambda: step(1), 4: lambda: step(4)}
    times = _timed_in_turns(runs, 4 * repeats, device)
    bare, one, four = (times[k] for k in ("bare", 1, 4))
    per_microbatch = max((four - one) / 3 - bare, 0.0)
    return per_microbatch, max(one - bare - per_microbatch, 0.0)


def _single_rank(fn, *args):
    """`fn` in a one-rank world: the optimizer wants a process group, and with one rank it never communicates."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()


def calibrate(device: str = "cpu", peak_flops: float | None = None, max_n: int | None = None,
              repeats: int = 5, name: str | None = None, *, in_job: bool = False) -> Profile:
    """Measure this machine (CPU with gloo, or one GPU) and return its profile.

    `in_job`: a training rank measures its own device before choosing a layout
    (`--layout auto` on CPU ranks). It keeps the thread count it will train with, and
    skips what needs a process group of its own, which it cannot create inside its job:
    the per-bucket optimizer cost (0 here) and the gloo link between two spawned ranks
    (the cluster's link figures stand in)."""
    dev = torch.device(device)
    cpu = dev.type == "cpu"
    if cpu and not in_job:
        torch.set_num_threads(1)
    dtype = torch.float32 if cpu else torch.bfloat16
    rates = _matmul_rates(dev, dtype, max_n or (1024 if cpu else 16384), repeats)
    peak = peak_flops or max(r for _, r in rates)
    # GPUs: head dim 128 (LLaMA, Mistral, Mixtral, Qwen), where flash kernels reach a higher FLOP rate than at
    # 64 (README, "On a GPU, predicted vs measured").
    attention = _attention_rate(dev, dtype, *((512, 4, 64) if cpu else (4096, 32, 128)), repeats)
    bw = _bandwidth(dev, repeats)
    layer_overhead, ends_overhead, moe_overhead, expert_overhead, selective, full = _fixed_costs(dev, repeats)
    bucket_overhead = 0.0 if in_job else _single_rank(_bucket_overhead, dev.type, repeats)
    microbatch_overhead, step_overhead = (0.0, 0.0) if in_job else _single_rank(_executor_overheads, dev.type,
                                                                                 repeats)
    links, slowdown, sp_comm, cores = (), (), 1.0, None
    if cpu:
        cores = max(1, len(os.sched_getaffinity(0)) // torch.get_num_threads())  # ranks that compute at once
    if cpu and not in_job:
        links, slowdown, sp_comm = _gloo_links(cores, 16 * 2**20, repeats)
    label = name or (f"cpu x{cores}" if cpu else torch.cuda.get_device_name(dev))
    return Profile(label, peak, tuple((f, r / peak) for f, r in rates), attention / peak, bw,
                   layer_overhead, ends_overhead, bucket_overhead, 1.0, links, cores, moe_overhead, expert_overhead,
                   selective, full, slowdown, sp_comm, microbatch_overhead, step_overhead,
                   meta={"dtype": str(dtype), "torch": torch.__version__})
