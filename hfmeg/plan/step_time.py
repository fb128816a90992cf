"""Seconds per training step of a layout on a cluster, from a calibrated `Profile`.

Per micro-batch and pipeline stage (all of the stage's chunks):
- matmuls: each of QKV, output projection, FC1, FC2 (and the LM head) at the
  profile's efficiency for its own size; backward is two matmuls of the same size
  per forward one; the chunked cross-entropy recomputes the head's logits once;
- attention core: the causal half of Megatron's 4·b·s²·h FLOPs forward, twice that
  backward, at the profile's attention efficiency;
- elementwise kernels (norms, RoPE, SwiGLU, residuals): three passes over the
  saved activations at streaming bandwidth, plus the profile's fixed cost per layer
  (and for the embedding and the head + loss);
- recompute: `full` runs each layer's forward again, `selective` the attention core;
- TP collectives: per layer two all-reduces forward and two backward (with SP the
  same bytes as all-gather + reduce-scatter pairs), ring cost on the TP link;
- p2p: one activation forward and one gradient back per chunk boundary.
The pipeline takes m·max(stage) plus the fill/drain bubble (p−1)/v·mean(stage).
Then per stage the data-parallel collectives of its buckets (fp32 gradient
reduce-scatter, parameter all-gather; `ddp`: a gradient all-reduce): `overlapped`
hides them behind the last micro-batch's backward and the first one's forward,
except one bucket's worth each; `distributed` runs both in series; `ddp` hides its
all-reduce behind the backward. Last, the AdamW update streams 36 bytes per owned
element (master, grad, two moments read and written, the parameter written), plus
the profile's fixed cost per bucket (its hooks, AdamW call and collectives' launch).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..config import ModelConfig
from ..optim.config import OptimizerConfig
from ..parallel.layout import rank_chunks, split_layers
from .flops import training_flops
from .activations import Shape, layer_bytes, layer_kinds, moe_tokens
from .hardware import ClusterSpec
from .layout import PlanLayout
from .memory import Memory, stage_memories
from .profile import Profile

ADAMW_BYTES_PER_ELEMENT = 36


@dataclass(frozen=True)
class StepTime:
    compute_s: float  # matmuls, attention, elementwise, recompute: slowest stage, whole step
    tp_comm_s: float
    p2p_s: float
    bubble_s: float
    dp_exposed_s: float
    optimizer_s: float
    step_s: float
    model_flops: float  # per step, all GPUs (Megatron's count, no recompute)
    gpus: int
    peak_flops: float
    tokens: int

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens / self.step_s / self.gpus

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_s / self.gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / self.step_s / self.gpus / self.peak_flops

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu}


def _link(cluster: ClusterSpec, prof: Profile, size: int, stride: int) -> tuple[float, float]:
    if prof.link_bytes_per_s is not None:
        return prof.link_bytes_per_s, prof.link_latency_s or 0.0
    bw, lat = cluster.link(size, stride)
    return bw * prof.link_efficiency, lat


def _ring(nbytes: float, n: int, link: tuple[float, float], passes: int = 1) -> float:
    """One reduce-scatter or all-gather (passes=1), or an all-reduce (passes=2), on a ring of n."""
    if n <= 1:
        return 0.0
    bw, lat = link
    return passes * ((n - 1) / n * nbytes / bw + (n - 1) * lat)


class _Stage:
    """Forward and backward seconds of one micro-batch on one pipeline stage."""

    def __init__(self, cfg: ModelConfig, lay: PlanLayout, prof: Profile, shape: Shape, tp_link, slow: float):
        self.cfg, self.lay, self.prof, self.shape, self.tp_link, self.slow = cfg, lay, prof, shape, tp_link, slow

    def _mm(self, m: int, k: int, n: int) -> float:
        flops = 2.0 * m * k * n
        return flops / (self.prof.peak_flops * self.prof.efficiency(flops))

    def _mlp(self, layer: int) -> tuple[float, int]:
        """(matmul seconds, TP all-reduce equivalents per forward + backward) of `layer`'s MLP.

        A dense MLP is column- then row-parallel: two all-reduces' worth of TP traffic per
        forward and backward. An MoE MLP runs whole experts on this rank's share of the
        tokens (models/moe.py): each expert's GEMMs on its average share of the routed rows,
        and without SP one all-gather of the outputs (half an all-reduce's bytes) per forward."""
        c, t, x = self.cfg, self.lay.tp, self.shape
        tok, h = x.micro_batch * x.seq_len, c.hidden_size
        if not c.is_sparse(layer):
            f = c.ffn_size // t
            return self._mm(tok, h, (2 if c.gated_mlp else 1) * f) + self._mm(tok, f, h), 2
        m, n = c.moe, moe_tokens(x)
        rows = n * m.top_k / m.num_experts
        mm = self._mm(n, h, m.num_experts) + m.num_experts * (self._mm(rows, h, 2 * m.expert_ffn_size)
                                                               + self._mm(rows, m.expert_ffn_size, h))
        if m.shared_expert_ffn_size:
            mm += self._mm(n, h, 2 * m.shared_expert_ffn_size + 1) + self._mm(n, m.shared_expert_ffn_size, h)
        return mm, 0 if x.sp else 0.5

    def layer(self, layer: int) -> tuple[float, float, float]:
        """(forward compute, backward compute, TP communication) of decoder layer `layer`."""
        c, t, x = self.cfg, self.lay.tp, self.shape
        tok, h, d = x.micro_batch * x.seq_len, c.hidden_size, c.head_dim
        nh, nkv = c.num_heads // t, c.num_kv_heads // t
        mlp, mlp_collectives = self._mlp(layer)
        mm = self._mm(tok, h, (nh + 2 * nkv) * d) + self._mm(tok, nh * d, h) + mlp
        attn = 2.0 * x.micro_batch * x.seq_len ** 2 * nh * d / (self.prof.peak_flops * self.prof.attention_efficiency)
        none = Shape(x.micro_batch, x.seq_len, t, x.sp, x.dtype_bytes, "none")
        elementwise = 3 * layer_bytes(c, none, layer) / self.prof.memory_bytes_per_s
        kernels = self.prof.layer_overhead_s
        fwd = mm + attn + (elementwise + kernels) / 3
        bwd = 2 * mm + 2 * attn + 2 * (elementwise + kernels) / 3
        ar = _ring(x.dtype_bytes * tok * h, t, self.tp_link, passes=2)
        comm = (2 + mlp_collectives) * ar
        if x.recompute == "full":
            bwd, comm = bwd + fwd, comm + 2 * ar
        elif x.recompute == "selective":
            bwd += attn
        return fwd * self.slow, bwd * self.slow, comm

    def head(self) -> tuple[float, float]:
        x, t = self.shape, self.lay.tp
        mm = self._mm(x.micro_batch * x.seq_len, self.cfg.hidden_size, self.cfg.padded_vocab(t) // t)
        return mm * self.slow, 3 * mm * self.slow  # backward: recomputed logits + two gradient matmuls


def step_time(cfg: ModelConfig, lay: PlanLayout, cluster: ClusterSpec, prof: Profile, global_batch: int,
              seq_len: int, dtype_bytes: int = 2, opt: OptimizerConfig | None = None,
              memories: list[Memory] | None = None) -> StepTime:
    """`memories`: the stages' `Memory` when the caller has them already (for their bucket sizes)."""
    opt = opt or OptimizerConfig(mode=lay.optimizer)
    memories = memories or stage_memories(cfg, lay, global_batch, seq_len, dtype_bytes, opt)
    shape = Shape(lay.micro_batch, seq_len, lay.tp, lay.sp, dtype_bytes, lay.recompute)
    m = lay.microbatches(global_batch)
    slow = max(1.0, lay.gpus / prof.cores) if prof.cores else 1.0
    tp_link = _link(cluster, prof, lay.tp, 1)
    pp_link = _link(cluster, prof, 2, lay.tp * lay.dp)
    dp_link = _link(cluster, prof, lay.dp, lay.tp)
    stage = _Stage(cfg, lay, prof, shape, tp_link, slow)
    costs = {cfg.is_sparse(i): stage.layer(i) for i in layer_kinds(cfg)}  # layers of one kind cost the same
    head_f, head_b = stage.head()
    p2p_msg = pp_link[1] + dtype_bytes * shape.local_seq * lay.micro_batch * cfg.hidden_size / pp_link[0]
    specs = split_layers(cfg.num_layers, lay.pp, lay.vpp)
    stages = []
    for r in range(lay.pp):
        mine = rank_chunks(specs, r)
        fwd_l, bwd_l, comm_l = (sum(parts) for parts in zip(*(costs[cfg.is_sparse(i)]
                                                              for s in mine for i in s.layers)))
        post = any(s.post_process for s in mine)
        ends = prof.ends_overhead_s / 2 * sum(s.pre_process + s.post_process for s in mine) * slow
        fwd = fwd_l + (head_f if post else 0.0) + ends / 3
        bwd = bwd_l + (head_b if post else 0.0) + 2 * ends / 3
        p2p = p2p_msg * sum((not s.pre_process) + (not s.post_process) for s in mine)
        stages.append((fwd, bwd, comm_l, p2p, memories[r]))
    per_mb = [f + b + c + p for f, b, c, p, _ in stages]
    slowest = max(range(lay.pp), key=lambda r: per_mb[r])
    bubble = (lay.pp - 1) / lay.vpp * sum(per_mb) / lay.pp
    f, b, c, p, _ = stages[slowest]

    def dp_and_update(fwd: float, bwd: float, mem: Memory) -> tuple[float, float]:
        padded, buckets = mem.param_buffer // dtype_bytes, mem.buckets
        shards = 1 if lay.optimizer == "ddp" else lay.dp
        update = (padded / shards * ADAMW_BYTES_PER_ELEMENT / prof.memory_bytes_per_s
                  + buckets * prof.bucket_overhead_s) * slow
        if lay.optimizer == "ddp":
            ar = _ring(4 * padded, lay.dp, dp_link, passes=2)
            return max(ar - bwd, ar / buckets), update
        rs, ag = _ring(4 * padded, lay.dp, dp_link), _ring(dtype_bytes * padded, lay.dp, dp_link)
        if lay.optimizer == "distributed":
            return rs + ag, update
        return max(rs - bwd, rs / buckets) + max(ag - fwd, ag / buckets), update

    tails = [dp_and_update(sf, sb, mem) for sf, sb, _, _, mem in stages]
    dp_exposed, update = max(tails, key=lambda t: t[0] + t[1])
    norm_latency = _link(cluster, prof, lay.gpus, 1)[1] * math.log2(max(lay.gpus, 2))
    total = m * per_mb[slowest] + bubble + dp_exposed + update + norm_latency
    return StepTime(m * (f + b), m * c, m * p, bubble, dp_exposed, update, total,
                    training_flops(cfg, global_batch, seq_len), lay.gpus, prof.peak_flops, global_batch * seq_len)
