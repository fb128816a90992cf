"""Bytes autograd saves for backward, per layer and per chunk, for hfmeg's own decoder.

These are not a textbook estimate but a count of what hfmeg's eager kernels
(the CPU default, `Kernels(None)`) hand to autograd, each storage once, so that
`SavedTensorMeter` can check them exactly. Notation: micro-batch b, sequence s,
s' = s/t under sequence parallelism (else s), hidden h, head_dim d, per TP rank
nh query heads, nkv KV heads and f FFN features, e = bytes of the model dtype.

Per layer, recompute `none`:
- each norm (two, or four with Gemma's and OLMo's norms on the sublayers' outputs, OLMo 2's
  two only): RMSNorm keeps x.float() (4·s'bh), rsqrt (4·s'b) and the normalised x in the
  model dtype (e·s'bh), or in fp32 (4·s'bh) where it scales in fp32: Gemma 2/3's by (1 + w),
  which it keeps too (4h), Gemma 4's by w (its fp32 copy, 4h, below fp32); LayerNorm keeps x
  (e·s'bh), mean and rstd (8·s'b);
- each column-parallel input (QKV, FC1): the norm's output, gathered to the full
  sequence under SP (e·sbh);
- attention: the fused QKV output (e·sb(nh+2nkv)d; V is a view of it, so is Q
  and K without RoPE), rotated Q and K with RoPE, SDPA's output (e·sb·nh·d) and
  log-sum-exp (4·b·nh·s), and the output projection's input (e·sb·nh·d), a copy
  unless Q was a view of QKV (one KV group per rank, or one query head per group),
  in which case SDPA's output keeps the sequence-major layout and the reshape is a view;
  a layer without RoPE (SmolLM3's) keeps no rotated Q and K but Q's copy where Q is not a
  view (or the normed Q and K with QK-norm); QK-norm per head keeps what a norm keeps on the
  Q and K rows (x.float(): Q's copy unless a view, K a view of QKV, fp32 copies of both below
  fp32; rsqrt per head; the normalised rows, and Gemma's (1 + w) per norm), OLMo 2's over the
  whole projection one rsqrt per token; Gemma 4's weightless value norm keeps its rsqrt (and
  below fp32 the fp32 copy of V), and its output is the V SDPA keeps (e·sb·nkv·d);
- MLP: FC1's output (e·sb·2f gated, e·sb·f plain), the activation's output (e·sbf)
  and, gated, the SwiGLU product (e·sbf);
- MoE MLP (models/moe.py), on this rank's n tokens (n = s'b under SP, else the
  ceil(sb/t) block of `split_tokens`) routed to k experts each: the router's input
  (the norm's output itself, e·s'bh, not an SP gather), fp32 routing probabilities
  (4·nE), top-k indices and values (12·nk), the renormalising sum (4·n), the sorted
  token and slot indices (16·nk), the weights gathered per row (nk·(4 if the combine
  is fp32, else e)), and per routed row the gathered input, FC1's output, the
  activation's output, the SwiGLU product, the expert output and the weighted output
  (e·nk·(3h + 4F)), and the int32 group offsets both grouped GEMMs keep (one tensor,
  4·E/EP); a shared expert adds a gated MLP on n tokens plus its sigmoid
  gate and output (e·n·(4F_s + 1 + h)). Dense layers of an MoE model count as above.
  With expert parallelism (EP > 1, parallel/expert_dispatch.py) the expert rows are the
  R rows this rank receives, not its own n·k: the expert-major reindexing of the
  received rows and the inverse permutation before the combine each keep an index
  (16·R), the all-to-all keeps nothing, and the combined rows (n·k) take the place of
  the expert outputs. The model takes balanced routing, R = n·k (each EP rank gets
  its experts' share of every rank's tokens); a skewed router moves bytes between ranks;
- Qwen3.5's gated attention (`attn_output_gate`) also keeps its gate rows in the fused QKV output, the gate's
  sigmoid (e·sb·nh·d) and, Q never a view of QKV there, Q's copy and the output projection's input copy;
- a Gated DeltaNet layer (models/gated_deltanet.py; per TP rank kh key and vh value heads of dk and dv dims, c conv
  channels, P in_proj rows, K taps, rows padded to n chunks of C = 64, S = nC): the in_proj output (e·sbP), the
  convolution's padded input (e·b(s + K − 1)c) and SiLU's input (e·sbc), the L2 norms' inputs (fp32: SiLU's output,
  4·sbc; else fp32 copies of q and k, 8·sb·kh·dk) and rsqrts (8·b·kh·s), the decay's exp(A_log) twice (8·vh),
  softplus's input and output (8·sb·vh), beta's sigmoid (e·sb·vh); the delta rule in fp32: six [b, vh, n, C, C]
  tensors (the float document mask, the decays, k kᵀ, the system, q kᵀ, the scores: 24·b·vh·nC²), the boolean masks
  (b·nC(C + 1)), three per-token scalars (exp of the summed decay, beta, the decay from the chunk start: 12·b·vh·S),
  k, k·beta, the solved w, q and the end-decayed k (20·b·vh·S·dk) and, with more than one chunk, the start-decayed q
  (4·b·vh·S·dk), v, the solved values and the corrected ones (12·b·vh·S·dv), one state per chunk (4·b·vh·n·dk·dv);
  the gated norm's input (fp32: the padded output, 4·b·vh·S·dv; else its fp32 copy, 4·sb·vh·dv), rsqrt (4·sb·vh),
  normalised rows, scaled rows, SiLU of the gate (fp32: 12·sb·vh·dv; else 12·sb·vh·dv + 2e·sb·vh·dv with the gate's
  fp32 copy) and the output projection's input (e·sb·vh·dv); `selective` keeps the in_proj output and the output
  projection's input. Exact (the meter) for rows of more than one chunk; a row of one chunk saves a few views in
  place of copies, which this count does not follow;
- DeepSeek's latent attention (models/latent_attention.py; per TP rank nh heads, q/k dk = nope + r and v dv wide,
  latents rq and rkv wide, n the rank's tokens: s'b) in place of the norm's column input and attention: the
  a-projections' input (the norm's output on the rank's tokens, e·n·h), each latent norm on the rank's tokens as a
  norm counts (x.float(): in fp32 the kv latent is a view of kv_a's whole output, 4·n(rkv + r)), each b-projection's
  input (the normed latent, gathered under SP: e·sb·rq and e·sb·rkv; without a query latent q's input, gathered
  under SP, else the norm's output), kv_b's output (e·sb·nh(nope + dv), V views it), the output projection's input (e·sb·nh·dv) and the
  core's: with dk ≠ dv the CPU's SDPA takes its math path, which saves Q and Kᵀ scaled copies (2e·sb·nh·dk) and the
  probabilities (e·b·nh·s²); flash (and dk = dv) saves the concatenated Q and K, the output and log-sum-exp
  instead; the RoPE'd rotated part is concatenated into K, so nothing keeps it apart. `selective` keeps the core's
  inputs instead: q_b's output, kv_b's, and k_rot (gathered under SP, else a view of kv_a's output). Under CP
  (counted from the code, not metered) K and V are gathered padded to one width. DeepSeek's grouped sigmoid
  routing keeps what the softmax router keeps (its group ranking and mask are dropped with the forward) and its
  shared experts, ungated, a gated MLP on n tokens;
- per chunk, not per layer: RoPE's cos and sin (2·e·bs·r, r the rotated dims: d, or fewer with
  partial rotary) for each table its layers read (Gemma 3's and OLMo 3's: one per layer type).
`selective` checkpoints the attention core (RoPE + SDPA), as Megatron does: the
QKV input, the fused QKV output and the output projection's input stay, rotated
Q/K, SDPA's output and log-sum-exp go; `full` keeps only each layer's input (e·s'bh).
The first chunk adds the token ids (8·bs), the TP range mask (bs), GPT-2's
position ids (8·s) and Gemma's embedding scale (a 0-dim tensor, e); the last adds the final norm, the LM head's input (e·sbh),
targets (8·bs), the log-sum-exp (4·bs) and the ignore mask (bs).

Context parallelism (CP, parallel/context.py): s above is the rank's s/cp tokens of
each row (s' = s/(cp·t) under SP), except in the attention core, whose keys and values
are the whole row's: SDPA saves the rotated Q (e·(s/cp)b·nh·d), the all-gathered K and
V in one storage (2e·b·nkv·s·d, for every layer, whatever cp), its output and
log-sum-exp, and the output projection's input as above, but neither the fused QKV
output nor the local rotated K (the gather's autograd keeps nothing). With a dense
mask (the CPU path; on CUDA flex attention takes a block mask) SDPA also saves the
chunk's additive mask, once per chunk: e·b·(s/cp)·s, the one term quadratic in s
(`Shape.dense_mask`), and a second one for the windowed layers where the row is longer
than the window.

Sliding windows and soft-capped scores on the CPU path (`Shape.dense_mask`; on CUDA flex
attention skips the tiles beyond the window and caps in its `score_mod`, saving what SDPA
saves): rows of one document, as counted here, attend plain causal, but a windowed layer
of a row longer than its window attends under the boolean `[1, 1, s, s]` window mask, of
which SDPA saves an additive copy in the model dtype, e·s² per such layer. Soft-capped
scores and scores with sinks (gpt-oss) are computed explicitly (models/document_attention.py
`_explicit`), which saves, instead of SDPA's output and log-sum-exp: the rotated Q, K and V
repeated to the query heads (K transposed into a copy; the rotated K itself is then saved by
nothing, nor, without QK-norm, the fused QKV output), the scores' tanh (e·b·nh·s·S, S the
keys: s, or the whole row under CP; none without a cap), the fp32 probabilities
(4·b·nh·s·S, a column more with sinks, and their e-byte copy below fp32), the boolean mask of the call (s² bytes; under CP the additive mask is added, which saves nothing,
so no chunk mask either), and the output projection's input, always a copy. Every family
that caps its scores has RoPE, which this count assumes.

On CUDA flex's sinks (rescaled by its log-sum-exp) save besides an fp32 factor per query and head (and its
cast below fp32), 4·b·nh·s; counted from the code, as no CPU run takes that path. gpt-oss's experts add an
int64 row index per bias (16·R bytes for R routed rows) and the clamped SwiGLU three e·R·F tensors more than
SwiGLU (the clamped gate, the sigmoid, up + 1).

Fused (compiled) kernels save less; the count is then an upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import ModelConfig
from ..models.gated_delta_rule import CHUNK


@dataclass(frozen=True)
class Shape:
    micro_batch: int
    seq_len: int
    tp: int
    sp: bool
    dtype_bytes: int
    recompute: str
    ep: int = 1
    cp: int = 1  # context-parallel ranks: `seq_len` is the row, a rank holds `seq` of its tokens
    # The CPU path: SDPA under dense masks (CP's, the window's), which it saves, and soft-capped scores computed
    # explicitly; False: CUDA's flex attention (block masks, capping in its score_mod)
    dense_mask: bool = False

    @property
    def seq(self) -> int:
        """A rank's tokens of each row (all of them at CP 1)."""
        return self.seq_len // self.cp

    @property
    def local_seq(self) -> int:
        return self.seq // self.tp if self.sp else self.seq


def _scaled(cfg: ModelConfig, e: int, rows: int, width: int) -> int:
    """What an RMSNorm's scaling saves on `rows` rows of `width`: the normalised rows in the model dtype (scaled in
    it: LLaMA's), or in fp32 with (1 + w) (Gemma 2/3's) or, below fp32, w's fp32 copy (Gemma 4's)."""
    if cfg.norm_offset:
        return 4 * rows * width + 4 * width
    if cfg.norm_fp32_scale:
        return 4 * rows * width + (4 * width if e != 4 else 0)
    return e * rows * width


def _norm(cfg: ModelConfig, x: Shape) -> int:
    tokens, e, h = x.local_seq * x.micro_batch, x.dtype_bytes, cfg.hidden_size
    return tokens * (4 * h + 4) + _scaled(cfg, e, tokens, h) if cfg.norm == "rms" else tokens * (e * h + 8)


def _head_norms(cfg: ModelConfig, x: Shape) -> int:
    """The q/k norms' and the value norm's saved bytes (module docstring), beside the fused QKV output they read."""
    b, s, e, d = x.micro_batch, x.seq, x.dtype_bytes, cfg.head_dim
    nh, nkv = cfg.num_heads // x.tp, cfg.local_kv_heads(x.tp)
    total = 0
    if cfg.qk_norm:
        q_is_view = _q_is_view(cfg, nh, nkv)
        inputs = 4 * b * s * (nh + nkv) * d if e != 4 else (0 if q_is_view else e * b * s * nh * d)
        if cfg.qk_norm_whole:  # one rsqrt per token and norm; the normalised rows scaled in the model dtype
            total += inputs + 2 * 4 * b * s + e * b * s * (nh + nkv) * d
        else:
            total += inputs + 4 * b * s * (nh + nkv) + _scaled(cfg, e, b * s * nh, d) + _scaled(cfg, e, b * s * nkv, d)
    if cfg.v_norm:  # no weight: its output is the V that attention saves (its own storage, not QKV's)
        normed = e * b * s * nkv * d if x.cp == 1 and not (x.dense_mask and explicit_scores(cfg)) else 0
        total += 4 * b * s * nkv + (4 * b * s * nkv * d if e != 4 else 0) + normed
    return total


def explicit_scores(cfg: ModelConfig) -> bool:
    """Whether the CPU path computes the attention scores explicitly: soft-capped, or with sinks (module docstring)."""
    return cfg.attn_softcap is not None or cfg.attn_sinks


def _explicit_core(cfg: ModelConfig, x: Shape) -> int:
    """The explicit attention's saved bytes (the CPU path of soft-capped scores or sinks: module docstring)."""
    b, s, keys, e, d = x.micro_batch, x.seq, x.seq_len, x.dtype_bytes, cfg.head_dim
    nh, nkv = cfg.num_heads // x.tp, cfg.local_kv_heads(x.tp)
    qkv = e * s * b * (nh + 2 * nkv) * d if cfg.qk_norm else 0  # the q/k norms' inputs are views of it
    rows = e * b * nh * d * (2 * s + 2 * keys)  # rotated Q, the repeated K and V, the output projection's input
    tanh = e if cfg.attn_softcap is not None else 0
    # the tanh, the fp32 probabilities (a column more with sinks) and their cast below fp32
    scores = b * nh * s * keys * (tanh + 4 + (e if e != 4 else 0)) + (4 * b * nh * s if cfg.attn_sinks else 0)
    return qkv + rows + scores + (s * s if x.cp == 1 else 0)


def _q_is_view(cfg: ModelConfig, nh: int, nkv: int) -> bool:
    """Whether Q is a view of the fused QKV output (one KV group per rank, or one query head per group, and no gate
    rows between the heads)."""
    return (nkv == 1 or nh == nkv) and not cfg.attn_output_gate


def _linear_attention(cfg: ModelConfig, x: Shape) -> int:
    """A Gated DeltaNet layer's saved bytes beside its input projection's input (module doc)."""
    la, b, s, e = cfg.linear_attention, x.micro_batch, x.seq, x.dtype_bytes
    t, kh, vh, dk, dv = b * s, la.key_heads // x.tp, la.value_heads // x.tp, la.key_dim, la.value_dim
    c, width, out = la.conv_channels // x.tp, sum(la.in_pieces()) // x.tp, e * b * s * vh * dv
    if x.recompute == "selective":
        return e * t * width + out
    n = -(-s // CHUNK)
    rows, pairs = 4 * b * vh * n * CHUNK, 4 * b * vh * n * CHUNK * CHUNK
    conv = e * t * width + e * b * (s + la.conv_kernel - 1) * c + e * t * c
    qk = (4 * t * c if e == 4 else 8 * t * kh * dk) + 8 * b * kh * s
    gates = 8 * vh + 8 * t * vh + e * t * vh
    rule = 6 * pairs + b * n * CHUNK * (CHUNK + 1) + 3 * rows + rows * dk * (5 + (n > 1)) + rows * dv * 3 \
        + n * 4 * b * vh * dk * dv
    norm = 4 * t * vh + (rows * dv + 12 * t * vh * dv if e == 4 else 12 * t * vh * dv + 2 * out)
    return conv + qk + gates + rule + norm + out


def _latent_attention(cfg: ModelConfig, x: Shape) -> int:
    """A latent attention layer's saved bytes, its input (the norm's output) included (module doc)."""
    m, b, s, e, h = cfg.mla, x.micro_batch, x.seq, x.dtype_bytes, cfg.hidden_size
    n, t, nh = x.local_seq * b, s * b, cfg.num_heads // x.tp
    qk, dv, kv_rows = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank

    def latent(width: int, fp32_input: int) -> int:  # a latent norm on the rank's tokens, then the gathered latent
        return fp32_input + 4 * n + _scaled(cfg, e, n, width) + e * t * width

    if m.q_lora_rank is None:  # under SP q gathers the norm's output; else it reads the a-projections' input
        total = e * n * h + (e * t * h if x.sp else 0)
    else:
        total = e * n * h + latent(m.q_lora_rank, 4 * n * m.q_lora_rank)
    # in fp32 the kv norm's x.float() is the latent, a view of kv_a's whole output
    total += latent(kv_rows, 4 * n * (kv_rows + (m.qk_rope_head_dim if e == 4 else 0)))
    total += e * t * nh * dv  # the output projection's input
    kv_out = e * t * nh * (m.qk_nope_head_dim + dv)  # kv_b's output, which V views
    if x.recompute == "selective":  # the core's inputs: q, kv and k_rot (gathered under SP, else kv_a's output)
        k_rot = e * t * m.qk_rope_head_dim if x.sp else (0 if e == 4 else e * n * (kv_rows + m.qk_rope_head_dim))
        return total + kv_out + e * t * nh * qk + k_rot
    if x.cp > 1:  # q, the gathered K and V padded to one width in one storage, the output, the log-sum-exp
        return total + e * t * nh * qk + 2 * e * b * nh * x.seq_len * max(qk, dv) + e * t * nh * dv \
            + 4 * b * nh * s
    if x.dense_mask and qk != dv:  # the CPU's math SDPA: scaled Q and Kᵀ copies, the probabilities, V
        return total + 2 * e * t * nh * qk + e * b * nh * s * s + kv_out
    return total + 2 * e * t * nh * qk + kv_out + e * t * nh * dv + 4 * b * nh * s  # Q, K, V, output, lse


def _windowed_mask(cfg: ModelConfig, x: Shape, layer: int) -> bool:
    """Whether layer `layer` attends under the window's dense mask (the CPU path, rows longer than the window)."""
    window = cfg.window(layer)
    return x.dense_mask and window is not None and x.seq_len > window


def _attention_core(cfg: ModelConfig, x: Shape, layer: int) -> int:
    if x.dense_mask and explicit_scores(cfg):
        return _explicit_core(cfg, x) + _head_norms(cfg, x)
    sb, e, d = x.seq * x.micro_batch, x.dtype_bytes, cfg.head_dim
    nh, nkv = cfg.num_heads // x.tp, cfg.local_kv_heads(x.tp)
    q_is_view = _q_is_view(cfg, nh, nkv)
    # flex's sinks (CUDA): the rescaling's fp32 factor per query and head, and its cast below fp32
    sunk = (4 + (e if e != 4 else 0)) * x.micro_batch * nh * x.seq if cfg.attn_sinks else 0
    total = 4 * x.micro_batch * nh * x.seq + e * sb * nh * d + (0 if q_is_view else e * sb * nh * d) \
        + _head_norms(cfg, x) + sunk
    if cfg.attn_output_gate:  # the gate's sigmoid, and the wider fused QKV output (its gate rows)
        total += e * sb * nh * d * (1 + (x.cp == 1))
    rotates = cfg.uses_rope(layer)
    if x.cp == 1:
        window_mask = e * x.seq * x.seq if _windowed_mask(cfg, x, layer) else 0  # SDPA's additive copy
        if rotates:
            qk = e * sb * (nh + nkv) * d  # rotated Q and K
        else:  # normed Q and K, or Q's copy (otherwise views of QKV)
            qk = e * sb * (nh * (cfg.qk_norm or not q_is_view) + nkv * cfg.qk_norm) * d
        return total + e * sb * (nh + 2 * nkv) * d + qk + window_mask
    gathered_kv = 2 * e * x.micro_batch * nkv * x.seq_len * d
    query = e * sb * nh * d if rotates else e * sb * (nh + 2 * nkv) * d  # else a view of QKV
    return total + gathered_kv + query


def layer_kind(cfg: ModelConfig, layer: int) -> tuple[bool, bool]:
    """What a layer's costs depend on beyond the shapes: (sparse MLP, linear attention)."""
    return cfg.is_sparse(layer), cfg.is_linear(layer)


def layer_kinds(cfg: ModelConfig) -> list[int]:
    """One layer index of each kind the model has (`layer_kind`), for costs that differ only by kind."""
    kinds = {layer_kind(cfg, i): i for i in reversed(range(cfg.num_layers))}
    return sorted(kinds.values())


def moe_tokens(x: Shape) -> int:
    """Tokens a TP rank routes: its sequence shard under SP, else its block of `comm.split_tokens`."""
    sb = x.seq * x.micro_batch
    return sb // x.tp if x.sp else -(-sb // x.tp)


def _moe(cfg: ModelConfig, x: Shape) -> int:
    m, e, h, n = cfg.moe, x.dtype_bytes, cfg.hidden_size, moe_tokens(x)
    k, f = m.top_k, m.expert_ffn_size
    routing = 4 * n * m.num_experts + 12 * n * k + (4 * n if m.norm_topk_prob else 0) + 16 * n * k \
        + n * k * (4 if m.combine_fp32 else e)
    offsets = 4 * (m.num_experts // x.ep)  # the grouped GEMMs' int32 offsets, one tensor kept by fc1's and fc2's
    experts = e * n * k * (3 * h + 4 * f) + offsets + (16 * n * k if x.ep > 1 else 0)  # R = n·k received rows
    if m.expert_bias:  # gpt-oss: each bias's rows gathered by an int64 index (repeat_interleave)
        experts += 16 * n * k
    if m.swiglu_limit is not None:  # the clamped SwiGLU: the clamped gate, the sigmoid and up + 1 besides
        experts += 3 * e * n * k * f
    shared = e * n * (4 * m.shared_expert_ffn_size + (1 + h if m.shared_expert_gate else 0)) \
        if m.shared_expert_ffn_size else 0
    return e * x.local_seq * x.micro_batch * h + routing + experts + shared


def layer_bytes(cfg: ModelConfig, x: Shape, layer: int = 0) -> int:
    """Saved bytes of decoder layer `layer` for one micro-batch."""
    e, h = x.dtype_bytes, cfg.hidden_size
    if x.recompute == "full":
        return e * x.local_seq * x.micro_batch * h
    sb, f = x.seq * x.micro_batch, cfg.ffn_size // x.tp
    column_input = e * sb * h
    mlp = _moe(cfg, x) if cfg.is_sparse(layer) else \
        column_input + e * sb * (4 * f if cfg.gated_mlp else 2 * f)
    if cfg.mla is not None:
        attention = _latent_attention(cfg, x)
    elif cfg.is_linear(layer):
        attention = column_input + _linear_attention(cfg, x)
    elif x.recompute == "selective":
        nh, nkv = cfg.num_heads // x.tp, cfg.local_kv_heads(x.tp)
        attention = column_input + e * sb * (nh * cfg.q_rows // cfg.head_dim + nh + 2 * nkv) * cfg.head_dim
    else:
        attention = column_input + _attention_core(cfg, x, layer)
    return (2 * cfg.pre_norms + 2 * cfg.sandwich_norms) * _norm(cfg, x) + attention + mlp


def chunk_bytes(cfg: ModelConfig, x: Shape, layers: range, pre_process: bool, post_process: bool) -> int:
    """Saved bytes of one model chunk (its layers plus the ends it owns) for one micro-batch."""
    bs, e = x.micro_batch * x.seq, x.dtype_bytes
    total = sum(layer_bytes(cfg, x, i) for i in layers)
    if x.recompute == "none":  # cos and sin of each RoPE table the layers read (Gemma 3's: one per layer type)
        total += 2 * e * bs * cfg.rotary_dim * len({cfg.rope_key(i) for i in layers
                                                    if cfg.uses_rope(i) and not cfg.is_linear(i)})
    if layers and x.cp > 1 and x.dense_mask and x.recompute == "none" and not explicit_scores(cfg):
        # the CP attention's additive mask, saved by every layer's SDPA (recompute holds it outside autograd), and
        # the windowed layers' own
        total += e * bs * x.seq_len * (2 if any(_windowed_mask(cfg, x, i) for i in layers) else 1)
    if pre_process:  # a scaled embedding (Gemma) keeps its scale, a 0-dim tensor in the model dtype
        total += 8 * bs + (bs if x.tp > 1 else 0) + (8 * x.seq if cfg.positions == "learned" else 0) \
            + (e if cfg.embed_scale else 0)
    if post_process:
        total += _norm(cfg, x) + e * bs * cfg.hidden_size + (8 + 4 + 1) * bs
        if cfg.adds_aux_loss:  # the load-balancing loss's product (C/R by P/R, E fp32 each) and P/R's divisor
            total += 4 * (2 * cfg.moe.num_experts + 1)
    return total


def received_input_bytes(cfg: ModelConfig, x: Shape) -> int:
    """A later chunk's received activation, which the pipeline holds until that micro-batch's backward.

    In fp32 it is the very storage the first norm (or `full` recompute) saves, so it
    costs nothing extra; in 16-bit the norm saves an fp32 copy instead.
    """
    if x.dtype_bytes == 4 or x.recompute == "full":
        return 0
    return x.dtype_bytes * x.local_seq * x.micro_batch * cfg.hidden_size


def recompute_transient_bytes(cfg: ModelConfig, x: Shape) -> int:
    """What backward re-creates for one layer at a time (not seen by the saved-tensor meter)."""
    if x.recompute == "none":
        return 0
    again = replace(x, recompute="none")
    return max(layer_bytes(cfg, again, i) - layer_bytes(cfg, x, i) for i in layer_kinds(cfg))
