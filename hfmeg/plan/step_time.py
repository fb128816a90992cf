"""Seconds per training step of a layout on a cluster, from a calibrated `Profile`.

Per micro-batch and pipeline stage (all of the stage's chunks):
- matmuls: each of QKV, output projection, FC1, FC2 (and the LM head) at the
  profile's efficiency for its own size; backward is two matmuls of the same size
  per forward one; the chunked cross-entropy recomputes the head's logits once;
- attention core, `flash` (hfmeg's SDPA kernels): the causal half of Megatron's
  4·b·s²·h FLOPs forward, twice that backward, at the profile's attention efficiency.
  `unfused` is the kernel sequence Megatron-LM ran before flash attention (the SC21
  runs that `hfmeg plan published` compares with): the S = b·(a/t)·s² scores are
  materialised, all of them (the causal mask is applied, not skipped). Forward: QK^T
  (2·S·d FLOPs, writes the scores), the fused scale-mask-softmax (reads and writes
  them), dropout on the probabilities (reads, writes them and a byte mask), then PV
  (2·S·d FLOPs, reads them); backward: the same two GEMMs twice over, reading the
  probabilities and writing and reading their gradient twice, dropout's backward
  (reads the gradient and the mask, writes) and softmax's (reads the gradient and
  the output, writes). Each GEMM pair takes the longer of its FLOPs at the matmul
  curve (a batched GEMM at its total size) and its score traffic at streaming
  bandwidth (with head dims of 64-160 the score write, not the FLOPs, bounds QK^T);
  softmax and dropout are pure traffic: 2e + (2e + 1) bytes per score forward,
  3e + (2e + 1) backward, e the dtype's bytes;
- elementwise kernels (norms, RoPE, SwiGLU, residuals): three passes over the
  saved activations at streaming bandwidth, plus the profile's fixed cost per layer
  (an MoE layer's grows with the experts it holds) and for the embedding and the
  head + loss. On a CPU the fixed costs add to the compute (the same cores run
  both); on a GPU the host launches kernels ahead of the device, so a layer takes
  the longer of its device work and its fixed cost, and the ends' fixed costs hide
  behind the stage's device work the same way;
- DeepSeek's latent attention (MLA): its five GEMMs at their own sizes (the a-projections on the rank's
  tokens only), the core's QK^T at the keys' width and PV at the values' narrower one, and TP moving the
  latents before the attention instead of the hidden state (`_Stage._latent_attention`); its grouped
  sigmoid router adds a few fp32 passes over the token x expert scores forward (`_grouped_routing`);
- QLoRA (`peft.quantize`, a 4-bit base): each decoder linear's weight is dequantized before its forward GEMM and
  again for the backward's (`quant/qlora.py` keeps no dequantized copy), one pass reading its codes and absmax and
  writing the weight in the model dtype (`nf4.dequantize_bytes`) at streaming bandwidth, forward and backward;
- recompute: `full` runs each layer's forward again, `selective` the attention core;
- gradient accumulation: every micro-batch's weight gradients are added into the
  fp32 main grads, a pass over all the stage's parameters at streaming bandwidth
  (`grad_accumulate_bytes`): fused (`optim.grad_accumulation_fusion`, parallel/wgrad.py)
  the GEMM reads and writes the main grad (4 + 4 bytes); without, the hook also reads the
  gradient the GEMM wrote in the parameters' dtype (`parallel/grad_sync.py`);
- TP collectives: per layer two all-reduces forward and two backward (with SP the
  same bytes as all-gather + reduce-scatter pairs, times the profile's measured
  `sequence_parallel_comm`), ring cost on the TP link; on
  gloo also the ends' latency-bound ones (`_Stage.ends_comm`);
- p2p: one activation forward and one gradient back per chunk boundary;
- context parallelism (CP > 1): a rank computes its s/cp tokens of each row, its
  attention core its queries over the whole row (the load-balanced split gives every
  rank the same causal half); per layer the K/V all-gather forward and its
  reduce-scatter backward, 2e·b·nkv·s·d bytes gathered per rank over the CP group's
  link (again when selective or full recompute reruns the core); gradients are summed
  over DP x CP;
- expert parallelism (EP > 1): per MoE layer the dispatch and the combine
  all-to-all forward, the same two backward (and again in a `full` recompute), each
  sending e·n·k·h·(EP−1)/EP bytes per rank (n tokens routed k ways; the rows for the
  rank's own experts stay) over the EP group's link (NVLink while TP·EP ranks fit
  in a node, else the node's NICs), plus one latency per peer for the row counts
  exchanged first; each rank runs its E/EP experts on n·k·EP/E rows each (balanced
  routing), so a larger EP means fewer, larger expert GEMMs.
The pipeline takes m·max(stage) plus the fill/drain bubble (p−1)/v·mean(stage) (its
compute at the slowdown of half the ranks on a CPU host, as half the stages are idle)
and 2(p·v−1) messages in series.
Then per stage the data-parallel collectives of its buckets (fp32 gradient
reduce-scatter, parameter all-gather; `ddp`: a gradient all-reduce), dense buckets
over DP and, with EP > 1, expert buckets over the expert-DP group (DP/EP ranks,
TP·EP apart): `overlapped` hides them behind the last micro-batch's backward and the
first one's forward, except one bucket's worth each; `distributed` runs both in
series; `ddp` hides its all-reduce behind the backward. On gloo ranks (a CPU
profile) every bucket's collective pays its own latencies and none is hidden: gloo
runs them on the ranks' own threads, which wait for the cores the backward holds
(measured: the three modes take the same time there). After them, in series, the
owned gradient of sequence-parallel-role parameters is all-reduced over TP (SP norms;
an MoE layer's router and experts, which each TP rank trains on its own tokens).
Last, the AdamW update streams 36 bytes per owned element (master, grad, two moments
read and written, the parameter written), plus the profile's fixed cost per bucket
(its hooks, AdamW call and collectives' launch). The executor's fixed costs (per
micro-batch and chunk, like the ends', and per step) come from the profile.

CPU ranks (a profile with `cores`: one intra-op thread per rank) share the host: every
rank computes (compute, fixed costs, the update) as many times slower than one rank
alone as the profile measured with that many ranks on the host (without a
measurement: ranks/cores once they outnumber the cores), and its collectives run
at the gloo link measured with that many ranks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from ..config import ModelConfig
from ..errors import UnsupportedConfigError
from ..optim.config import OptimizerConfig
from ..parallel.layout import rank_chunks, split_layers
from ..parallel.linear_cross_entropy import CE_CHUNK_TOKENS
from .flops import training_flops
from .activations import Shape, layer_bytes, layer_kind, layer_kinds, moe_tokens
from ..quant.nf4 import dequantize_bytes
from .fp8 import fp8_cast_bytes
from .hardware import ClusterSpec
from .layout import PlanLayout
from .memory import Memory, plan_shape, stage_memories
from .profile import Profile

ADAMW_BYTES_PER_ELEMENT = 36


def grad_accumulate_bytes(dtype_bytes: int, fused: bool) -> int:
    """Bytes moved per parameter element when one micro-batch's gradient joins the main grad: the fp32 main
    grad read and written, and without gradient-accumulation fusion (parallel/wgrad.py) the gradient the
    GEMM wrote in the parameters' dtype read back (fused, the GEMM adds into the main grad itself)."""
    return 4 + 4 + (0 if fused else dtype_bytes)


@dataclass(frozen=True)
class StepTime:
    compute_s: float  # matmuls, attention, elementwise, recompute: slowest stage, whole step
    reference_s: float  # a preference run's reference forward over the step's micro-batches (0 without one)
    tp_comm_s: float
    ep_comm_s: float  # expert all-to-alls, slowest stage, whole step
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


def _link(cluster: ClusterSpec, prof: Profile, crossing: set[str], kind: str, size: int, stride: int,
          all_to_all: bool = False) -> tuple[float, float]:
    """(bytes/s, latency) of a `kind` group (of `grid.GROUP_KINDS`, or "world") of `size` ranks `stride` apart;
    `crossing`: the kinds whose groups the rank grid puts on more than one node.

    On gloo (a CPU profile) every message pays the gloo link measured with all the job's ranks on the
    machine; one that crosses nodes also goes through the node's link: the ring moves at the slower of
    the two and pays both latencies."""
    crosses = kind in crossing
    measured = prof.link(cluster.gpus)  # CPU: gloo as measured with this many ranks on the host
    bw, lat = cluster.link(size, stride, all_to_all, crosses=crosses)
    if measured is None:
        return bw * prof.link_efficiency, lat
    if not crosses or size == 1:
        return measured
    return min(measured[0], bw), measured[1] + lat


def _ring(nbytes: float, n: int, link: tuple[float, float], passes: int = 1, collectives: int = 1) -> float:
    """One reduce-scatter or all-gather (passes=1), or an all-reduce (passes=2), on a ring of n; with
    `collectives`, the bytes split over that many, each paying the latencies."""
    if n <= 1:
        return 0.0
    bw, lat = link
    return passes * ((n - 1) / n * nbytes / bw + collectives * (n - 1) * lat)


def crossing_kinds(lay: PlanLayout, cluster: ClusterSpec) -> set[str]:
    """The kinds of process group whose groups span nodes when `lay`'s rank grid is placed `cluster.gpus_per_node`
    ranks to a node (`RankGrid.crossing`), and "world" when there is more than one node. "pp" only when the
    first stage boundary crosses: p2p is timed at one boundary's link, and a node that holds the first two
    stages keeps that boundary on NVLink."""
    grid = replace(lay.grid, per_host=min(cluster.gpus_per_node, lay.gpus))
    kinds = set(grid.crossing()) - {"pp"} | ({"world"} if grid.hosts > 1 else set())
    return kinds | ({"pp"} if lay.pp > 1 and grid.host(grid.rank(pp=1)) != grid.host(0) else set())


ATTENTION_KERNELS = ("flash", "unfused")


def _all_to_all(nbytes: float, n: int, link: tuple[float, float]) -> float:
    """One all-to-all of `nbytes` per rank over n ranks: (n−1)/n of them leave, one message per peer,
    which is what one ring pass costs."""
    return _ring(nbytes, n, link)


class _Stage:
    """Forward and backward seconds of one micro-batch on one pipeline stage."""

    def __init__(self, cfg: ModelConfig, lay: PlanLayout, prof: Profile, shape: Shape, tp_link, ep_link,
                 slow: float, attention: str, cp_link=None, fp8: bool = False, base_4bit: bool = False):
        self.cfg, self.lay, self.prof, self.shape, self.slow, self.fp8 = cfg, lay, prof, shape, slow, fp8
        self.base_4bit = base_4bit
        self.tp_link, self.ep_link, self.attention, self.cp_link = tp_link, ep_link, attention, cp_link
        self.sp_comm = prof.sequence_parallel_comm if lay.sp else 1.0

    def _mm(self, m: int, k: int, n: int) -> float:
        flops = 2.0 * m * k * n
        return flops / (self.prof.peak_flops * self.prof.efficiency(flops))

    def _linear(self, m: int, k: int, n: int) -> float:
        """A decoder linear's GEMM `[m, k] x [k, n]`; with `model.fp8` (plan/fp8.py) the FP8 GEMM and its operands'
        casts."""
        if not self.fp8:
            return self._mm(m, k, n)
        return self._mm(m, k, n) / self.prof.fp8_matmul_speedup + \
            fp8_cast_bytes(m, k, n, self.shape.dtype_bytes) / self.prof.memory_bytes_per_s

    def _mlp(self, layer: int) -> tuple[float, int, float]:
        """(matmul seconds, TP all-reduce equivalents per forward + backward, one forward's
        all-to-all seconds) of `layer`'s MLP.

        A dense MLP is column- then row-parallel: two all-reduces' worth of TP traffic per
        forward and backward. An MoE MLP runs whole experts on this rank's share of the
        tokens (models/moe.py): each of the rank's E/EP experts' GEMMs on its average share
        of the routed rows, and without SP one all-gather of the outputs (half an
        all-reduce's bytes) per forward. With EP > 1 the routed rows travel there and back."""
        c, t, x = self.cfg, self.lay.tp, self.shape
        tok, h = x.micro_batch * x.seq, c.hidden_size
        if not c.is_sparse(layer):
            f = c.ffn_size // t
            return self._linear(tok, h, (2 if c.gated_mlp else 1) * f) + self._linear(tok, f, h), 2, 0.0
        m, n, ep = c.moe, moe_tokens(x), self.lay.ep
        local = m.num_experts // ep
        rows = n * m.top_k / local
        mm = self._mm(n, h, m.num_experts) + local * (self._linear(rows, h, 2 * m.expert_ffn_size)
                                                      + self._linear(rows, m.expert_ffn_size, h))
        if m.shared_expert_ffn_size:
            mm += self._linear(n, h, 2 * m.shared_expert_ffn_size + 1) + self._linear(n, m.shared_expert_ffn_size, h)
        counts = (ep - 1) * self.ep_link[1] if ep > 1 else 0.0
        a2a = 2 * _all_to_all(x.dtype_bytes * n * m.top_k * h, ep, self.ep_link) + counts
        return mm, 0 if x.sp else 0.5, a2a

    def _attention(self) -> tuple[float, float]:
        """(forward, backward) seconds of one layer's attention core (see the module docstring): QK^T at the
        keys' width, PV at the values' (MLA's values are narrower than its queries and keys)."""
        x, prof, c = self.shape, self.prof, self.cfg
        nh, e = c.num_heads // self.lay.tp, x.dtype_bytes
        dk, dv = c.head_dim, (c.mla.v_head_dim if c.mla is not None else c.head_dim)
        scores = x.micro_batch * nh * x.seq * x.seq_len  # a CP rank's queries over the whole row
        if self.attention == "flash":
            fwd = 1.0 * scores * (dk + dv) / (prof.peak_flops * prof.attention_efficiency)
            return fwd, 2 * fwd
        queries = x.micro_batch * nh * x.seq
        pair = max(self._mm(queries, dk, x.seq_len) + self._mm(queries, dv, x.seq_len),  # QK^T and PV, batched
                   2 * e * scores / prof.memory_bytes_per_s)
        fwd = pair + (2 * e + 2 * e + 1) * scores / prof.memory_bytes_per_s
        return fwd, 2 * pair + (3 * e + 2 * e + 1) * scores / prof.memory_bytes_per_s

    def layer(self, layer: int) -> tuple[float, float, float, float]:
        """(forward compute, backward compute, TP communication, EP all-to-all) of decoder layer `layer`."""
        c, t, x = self.cfg, self.lay.tp, self.shape
        tok, h, d = x.micro_batch * x.seq, c.hidden_size, c.head_dim
        nh, nkv = c.num_heads // t, c.local_kv_heads(t)
        mlp, mlp_collectives, a2a = self._mlp(layer)
        if c.mla is not None:
            attention_mm, attention_comm, kv_width = self._latent_attention()
        else:
            attention_mm, kv_width = self._linear(tok, h, (nh + 2 * nkv) * d) + self._linear(tok, nh * d, h), nkv * d
        mm = attention_mm + mlp
        dequant = self._dequantize() if self.base_4bit else 0.0
        attn, attn_bwd = self._attention()
        none = replace(x, recompute="none")
        elementwise = 3 * layer_bytes(c, none, layer) / self.prof.memory_bytes_per_s
        kernels = self.prof.layer_fixed_s(c.moe.num_experts // self.lay.ep if c.is_sparse(layer) else None)
        # (device work, fixed cost) of the forward and of the backward
        fwd = mm + dequant + attn + elementwise / 3 + self._grouped_routing(layer), kernels / 3
        bwd = 2 * mm + dequant + attn_bwd + 2 * elementwise / 3, 2 * kernels / 3
        ar = _ring(x.dtype_bytes * tok * h, t, self.tp_link, passes=2) * self.sp_comm
        if c.mla is None:
            attention_comm = 2 * ar
        # CP: the K/V all-gather forward (again when the core is recomputed), its reduce-scatter backward.
        kv = _ring(2 * x.dtype_bytes * x.micro_batch * kv_width * x.seq_len, self.lay.cp, self.cp_link) \
            if self.lay.cp > 1 else 0.0
        comm = attention_comm + mlp_collectives * ar + 2 * kv
        ep_comm = 2 * a2a  # the forward's two exchanges, and the backward's two
        if x.recompute == "full":
            bwd = bwd[0] + fwd[0], bwd[1] + self.prof.full_recompute_fixed * kernels
            comm, ep_comm = comm + attention_comm / 2 + ar + kv, ep_comm + a2a
        elif x.recompute == "selective":
            bwd = bwd[0] + attn, bwd[1] + self.prof.selective_recompute_fixed * kernels
            comm += kv
        return self.with_fixed(*fwd) * self.slow, self.with_fixed(*bwd) * self.slow, comm, ep_comm

    def _dequantize(self) -> float:
        """Seconds to dequantize a dense layer's four 4-bit linears as this rank holds them, once (QLoRA)."""
        c, t = self.cfg, self.lay.tp
        h, d, nh, nkv, f = c.hidden_size, c.head_dim, c.num_heads // t, c.local_kv_heads(t), c.ffn_size // t
        weights = (h * (nh + 2 * nkv) * d, nh * d * h, h * (2 if c.gated_mlp else 1) * f, f * h)
        return sum(dequantize_bytes(w, self.shape.dtype_bytes) for w in weights) / self.prof.memory_bytes_per_s

    def _latent_attention(self) -> tuple[float, float, int]:
        """(matmul seconds, TP seconds per forward + backward, K/V width gathered per key under CP) of MLA.

        The a-projections run on the rank's tokens (its SP shard, else every token), the b-projections and the
        output projection on every token and the rank's heads. TP moves the latents (the query's, the kv latent and
        the shared rotated key: or the hidden state, for a query without a latent) where a layer moves its hidden
        state, an all-gather forward and a reduce-scatter backward under SP (an all-reduce of their gradients
        without), and the output projection's one collective of the hidden state as any layer's."""
        c, x, m = self.cfg, self.shape, self.cfg.mla
        tok, local, h, nh = x.micro_batch * x.seq, x.local_seq * x.micro_batch, c.hidden_size, c.num_heads // self.lay.tp
        qk, dv, kv = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank + m.qk_rope_head_dim
        mm = self._linear(local, h, kv) + self._linear(tok, m.kv_lora_rank, nh * (m.qk_nope_head_dim + dv)) \
            + self._linear(tok, nh * dv, h)
        if m.q_lora_rank is None:
            mm += self._linear(tok, h, nh * qk)
            latents = h + kv
        else:
            mm += self._linear(local, h, m.q_lora_rank) + self._linear(tok, m.q_lora_rank, nh * qk)
            latents = m.q_lora_rank + kv
        e, t = x.dtype_bytes, self.lay.tp
        comm = (_ring(e * tok * h, t, self.tp_link, passes=2) + _ring(e * tok * latents, t, self.tp_link, passes=2)) \
            * self.sp_comm
        return mm, comm, nh * max(qk, dv)  # CP gathers K and V padded to one width

    def _grouped_routing(self, layer: int) -> float:
        """Forward seconds of DeepSeek-V3's grouped routing beyond a softmax router's: the biased scores, the
        eligible experts' mask and the masked scores (fp32, 4 + 1 + 4 bytes per token and expert), each written
        and read once at streaming bandwidth."""
        c = self.cfg
        if not c.is_sparse(layer) or c.moe.scoring != "sigmoid":
            return 0.0
        return 2 * 9 * moe_tokens(self.shape) * c.moe.num_experts / self.prof.memory_bytes_per_s

    def with_fixed(self, device: float, fixed: float) -> float:
        """Seconds of device work with a fixed cost: added on a CPU, overlapped on a GPU (see the module docstring)."""
        return device + fixed if self.prof.gloo else max(device, fixed)

    def ends_comm(self, pre: bool, post: bool) -> float:
        """gloo: the TP collectives of the ends per micro-batch: the vocab-parallel embedding's output, the LM
        head input's gradient (hidden-sized, as a layer's), and per chunk of the loss's tokens two all-reduces
        (the logits' maximum; the sum of exponentials and the target logit)."""
        if not self.prof.gloo:
            return 0.0
        tok, e, t = self.shape.micro_batch * self.shape.seq, self.shape.dtype_bytes, self.lay.tp
        hidden = _ring(e * tok * self.cfg.hidden_size, t, self.tp_link, passes=2) * self.sp_comm
        loss = _ring(12 * tok, t, self.tp_link, passes=2, collectives=2 * math.ceil(tok / CE_CHUNK_TOKENS))
        return pre * hidden + post * (hidden + loss)

    def head(self) -> tuple[float, float]:
        x, t = self.shape, self.lay.tp
        vocab = self.cfg.padded_vocab(t, self.lay.vocab_multiple) // t
        mm = self._mm(x.micro_batch * x.seq, self.cfg.hidden_size, vocab)
        return mm * self.slow, 3 * mm * self.slow  # backward: recomputed logits + two gradient matmuls


def step_time(cfg: ModelConfig, lay: PlanLayout, cluster: ClusterSpec, prof: Profile, global_batch: int,
              seq_len: int, dtype_bytes: int = 2, opt: OptimizerConfig | None = None,
              memories: list[Memory] | None = None, attention: str = "flash",
              grad_accumulation: bool = True, reference_forward: bool = False, fp8: bool = False,
              base_4bit: bool = False) -> StepTime:
    """`memories`: the stages' `Memory` when the caller has them already (for their bucket sizes);
    `attention`: one of ATTENTION_KERNELS; `grad_accumulation`: time hfmeg's per-micro-batch pass into
    the main grads (False: a runtime whose pass is not modelled); `reference_forward`: a preference run's
    reference model runs forward-only over the step's micro-batches first (parts/reference.py): each
    micro-batch costs the slowest stage's forward compute and the forward halves of its TP, EP and p2p
    traffic, and the forward-only pipeline fills and drains once; `fp8`: the decoder linears run in FP8
    (`model.fp8`, plan/fp8.py); `base_4bit`: QLoRA's 4-bit base, dequantized for each GEMM."""
    if attention not in ATTENTION_KERNELS:
        raise UnsupportedConfigError(f"attention kernels {attention!r}: choose one of {ATTENTION_KERNELS}")
    opt = opt or OptimizerConfig(mode=lay.optimizer)
    memories = memories or stage_memories(cfg, lay, global_batch, seq_len, dtype_bytes, opt, fp8=fp8)
    shape = plan_shape(lay, seq_len, dtype_bytes)
    m = lay.microbatches(global_batch)
    slow = prof.compute_slowdown(lay.gpus)
    crossing = crossing_kinds(lay, cluster)
    tp_link = _link(cluster, prof, crossing, "tp", lay.tp, 1)
    pp_link = _link(cluster, prof, crossing, "pp", 2, lay.tp * lay.cp * lay.dp)
    dp_kind = "dp_cp" if lay.cp > 1 else "dp"
    dp_link = _link(cluster, prof, crossing, dp_kind, lay.replicas, lay.tp)  # gradients are summed over DP x CP
    cp_link = _link(cluster, prof, crossing, "cp", lay.cp, lay.tp)
    # EP ranks are DP neighbours: TP x CP ranks apart
    ep_link = _link(cluster, prof, crossing, "ep", lay.ep, lay.tp * lay.cp, all_to_all=True)
    edp_link = _link(cluster, prof, crossing, "expert_dp" if lay.ep > 1 else dp_kind, lay.edp * lay.cp,
                     lay.tp * lay.ep)
    stage = _Stage(cfg, lay, prof, shape, tp_link, ep_link, slow, attention, cp_link, fp8, base_4bit)
    costs = {layer_kind(cfg, i): stage.layer(i) for i in layer_kinds(cfg)}  # layers of one kind cost the same
    head_f, head_b = stage.head()
    p2p_msg = pp_link[1] + dtype_bytes * shape.local_seq * lay.micro_batch * cfg.hidden_size / pp_link[0]
    specs = split_layers(cfg.num_layers, lay.pp, lay.vpp)
    stages = []
    for r in range(lay.pp):
        mine = rank_chunks(specs, r)
        fwd_l, bwd_l, comm_l, a2a_l = (sum(parts) for parts in zip(*(costs[layer_kind(cfg, i)]
                                                                     for s in mine for i in s.layers)))
        post = any(s.post_process for s in mine)
        comm_l += sum(stage.ends_comm(s.pre_process, s.post_process) for s in mine)
        ends = (prof.ends_overhead_s / 2 * sum(s.pre_process + s.post_process for s in mine)
                + prof.microbatch_overhead_s * len(mine)) * slow
        grads = grad_accumulation * memories[r].param_buffer / dtype_bytes \
            * grad_accumulate_bytes(dtype_bytes, opt.grad_accumulation_fusion) \
            / prof.memory_bytes_per_s * slow
        fwd = stage.with_fixed(fwd_l + (head_f if post else 0.0), ends / 3)
        bwd = stage.with_fixed(bwd_l + (head_b if post else 0.0) + grads, 2 * ends / 3)
        # Each chunk boundary a rank touches carries two messages per micro-batch: the activation in the
        # forward and its gradient in the backward.
        p2p = 2 * p2p_msg * sum((not s.pre_process) + (not s.post_process) for s in mine)
        stages.append((fwd, bwd, comm_l, a2a_l, p2p, memories[r]))
    per_mb = [f + b + c + e + p for f, b, c, e, p, _ in stages]
    slowest = max(range(lay.pp), key=lambda r: per_mb[r])
    # Fill and drain: (p−1)/v stage-times of idle compute. While a pipeline fills or drains, about half its
    # stages compute, so CPU ranks sharing a host compute at the slowdown of half as many ranks (1 on a
    # GPU). And the first micro-batch's activation crosses every chunk boundary before the last chunk
    # starts, the last gradient crosses them all back: 2(p·v − 1) messages in series on the critical path.
    fill_slow = prof.compute_slowdown(max(1, lay.gpus // 2)) / slow
    bubble = (lay.pp - 1) / lay.vpp * sum((f + b) * fill_slow + c + e + p for f, b, c, e, p, _ in stages) / lay.pp \
        + 2 * (lay.pp * lay.vpp - 1) * p2p_msg
    f, b, c, e, p, _ = stages[slowest]

    def dp_and_update(fwd: float, bwd: float, mem: Memory) -> tuple[float, float]:
        padded, buckets = mem.param_buffer // dtype_bytes, mem.buckets
        sharded = lay.optimizer != "ddp"
        # (elements, collectives, group size, link): dense buckets over DP, expert buckets (EP > 1) over
        # expert-DP. gloo ranks (a CPU profile) pay each bucket's collective its latencies; GPU profiles
        # count one latency per kind of collective.
        gloo = prof.gloo
        groups = [g for g in ((padded - mem.expert_padded, buckets - mem.expert_buckets if gloo else 1, lay.replicas,
                               dp_link),
                              (mem.expert_padded, mem.expert_buckets if gloo else 1, lay.edp * lay.cp, edp_link))
                  if g[0]]
        owned = sum(n / size if sharded else n for n, _, size, _ in groups)
        update = (owned * ADAMW_BYTES_PER_ELEMENT / prof.memory_bytes_per_s + buckets * prof.bucket_overhead_s) * slow
        tp_sum = _ring(4 * mem.tp_summed, lay.tp, tp_link, passes=2) if mem.tp_summed else 0.0
        if not sharded:
            ar = sum(_ring(4 * n, size, link, passes=2, collectives=k) for n, k, size, link in groups)
            return (ar if gloo else max(ar - bwd, ar / buckets)) + tp_sum, update
        rs = sum(_ring(4 * n, size, link, collectives=k) for n, k, size, link in groups)
        ag = sum(_ring(dtype_bytes * n, size, link, collectives=k) for n, k, size, link in groups)
        if lay.optimizer == "distributed" or gloo:
            return rs + ag + tp_sum, update
        return max(rs - bwd, rs / buckets) + max(ag - fwd, ag / buckets) + tp_sum, update

    tails = [dp_and_update(sf, sb, mem) for sf, sb, _, _, _, mem in stages]
    dp_exposed, update = max(tails, key=lambda t: t[0] + t[1])
    norm_latency = _link(cluster, prof, crossing, "world", lay.gpus, 1)[1] * math.log2(max(lay.gpus, 2))
    reference = 0.0
    if reference_forward:
        forward = [sf + (sc + se + sp) / 2 for sf, _, sc, se, sp, _ in stages]
        reference = m * max(forward) + (lay.pp - 1) / lay.vpp * sum(forward) / lay.pp
    total = m * per_mb[slowest] + bubble + dp_exposed + update + norm_latency + prof.step_overhead_s * slow \
        + reference
    return StepTime(m * (f + b), reference, m * c, m * e, m * p, bubble, dp_exposed, update, total,
                    training_flops(cfg, global_batch, seq_len), lay.gpus, prof.peak_flops, global_batch * seq_len)
