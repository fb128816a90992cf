"""Measure one layout for real, to check the model against: peak bytes and step time.

`measure_cases` runs a list of `Case`s with one world size on forked gloo ranks
(`launch.spawn`): each case builds its rank's chunks (random weights), the
distributed optimizer, and runs `steps` training steps through the pipeline
executor. Memory is the saved-tensor meter's peak over one step plus the
optimizer's buffers and state, per rank, over a first step that also warms up;
time is the median of the `steps` later ones (without the meter's hooks), the
first of them dropped when there are several.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import ModelConfig
from ..data.microbatch import MicroBatch
from ..models.decoder import ModelChunk
from ..optim import DistributedOptimizer, OptimizerConfig
from ..parallel.activation_meter import SavedTensorMeter
from ..parallel.launch import spawn
from ..parallel.layout import rank_chunks, split_layers
from ..parallel.pipeline import forward_backward
from ..parallel.state import ParallelConfig, ParallelState
from .layout import PlanLayout


@dataclass(frozen=True)
class Case:
    cfg: ModelConfig
    layout: PlanLayout
    global_batch: int
    seq_len: int
    bucket_size: int = 40_000_000
    label: str = ""


def _batches(cfg: ModelConfig, n: int, rows: int, seq: int, seed: int) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, cfg.vocab_size, (rows, seq), generator=g)
        out.append(MicroBatch(input_ids=ids, labels=torch.cat([ids[:, 1:], torch.full((rows, 1), -100)], dim=1)))
    return out


def _run_case(case: Case, steps: int) -> dict:
    lay, cfg = case.layout, case.cfg
    ps = ParallelState(ParallelConfig(tp=lay.tp, pp=lay.pp, vpp=lay.vpp, sequence_parallel=lay.sp, ep=lay.ep,
                                      cp=lay.cp), dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    torch.manual_seed(0)
    chunks = [ModelChunk(cfg, ps, s.layers, pre_process=s.pre_process, post_process=s.post_process,
                         recompute=lay.recompute, vocab_multiple=lay.vocab_multiple)
              for s in rank_chunks(split_layers(cfg.num_layers, lay.pp, lay.vpp), ps.pp_rank)]
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.normal_(0.0, 0.02)
    opt = DistributedOptimizer(chunks, ps, OptimizerConfig(mode=lay.optimizer, bucket_size=case.bucket_size))
    m = lay.microbatches(case.global_batch)
    # a DP replica's rows, each CP rank with its share of every row (parallel/context.py)
    mbs = [mb.shard(ps.cp_rank, ps.cp) for mb in _batches(cfg, m, lay.micro_batch, case.seq_len, seed=ps.dp_rank)]
    tokens = case.global_batch * (case.seq_len - 1)
    meter = SavedTensorMeter(chunks)
    times = []
    for step in range(steps + 1):  # step 0 measures memory (the meter's hooks cost time), the rest time
        dist.barrier()
        t0 = time.perf_counter()
        with meter.hooks() if step == 0 else nullcontext():
            forward_backward(chunks, ps, mbs, schedule=lay.schedule, num_tokens=tokens, grad_sync=opt,
                             loss_scale=opt.loss_scale)
        opt.step()
        opt.wait_params()  # the next step's forward would wait for these: charge them to this step
        dist.barrier()
        times.append(time.perf_counter() - t0)
    peak = meter.peak
    buffers = sum(g.param_buffer.numel() * g.param_buffer.element_size()
                  + g.grad_buffer.numel() * g.grad_buffer.element_size() for g in opt.groups)
    return dict(rank=dist.get_rank(), pp_rank=ps.pp_rank, activations=peak, buffers=buffers,
                optimizer_state=opt.state_bytes(), bytes=peak + buffers + opt.state_bytes(),
                step_s=statistics.median(times[2:] if steps > 1 else times[1:] or times))


def _worker(cases: list[Case], steps: int) -> list[dict]:
    return [_run_case(c, steps) for c in cases]


def measure_cases(cases: list[Case], steps: int = 3, timeout_s: float = 600.0) -> list[list[dict]]:
    """Per case, per rank results. All cases must have the same world size."""
    worlds = {c.layout.gpus for c in cases}
    if len(worlds) != 1:
        raise ValueError(f"measure_cases needs one world size per call, got {sorted(worlds)}")
    per_rank = spawn(_worker, worlds.pop(), cases, steps, timeout_s=timeout_s)
    return [[r[i] for r in per_rank] for i in range(len(cases))]
