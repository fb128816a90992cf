"""Tensor-parallel self-attention with fused per-group QKV, GQA/MQA and SDPA.

The fused QKV weight is laid out per KV group, `[q heads of group g; k_g; v_g]`, and
split by whole groups across TP ranks, so each rank computes its heads with no
communication between the QKV projection and the output projection.

With fewer KV heads than TP ranks (Gemma-3-1B's one, at TP 2) the KV heads are replicated, as
Megatron-Core does: the `TP / KV` consecutive ranks whose query heads share KV head g each hold
`[their share of group g's q heads; k_g; v_g]` (`qkv_split` below, a `parallel/splits.py` `Fused` kind, builds and
undoes that layout).
The K and V rows are copies, so their gradients, which each holder gets from its own queries only,
are summed over the holders once per step (role `shared_rows`, `parallel/roles.py`); a per-head k norm
already sums over TP. The forward needs nothing new: each rank attends with its one KV head.

Qwen3's q/k norms (`cfg.qk_norm`) are RMSNorms over the head dim, applied to every
query and key head before RoPE. One weight serves all heads, so it is TP-replicated;
each rank's gradient comes from its own heads only, so its role says
`sequence_parallel` (summed over TP), with or without SP. OLMo 2's (`cfg.qk_norm_whole`) span all the heads
of a token: their weights are TP-sharded with the heads (`norm.HeadsRMSNorm`). Gemma 4 normalises each value head
too, with no weight (`cfg.v_norm`).

gpt-oss's attention sinks (`cfg.attn_sinks`): a learned logit per query head that joins the softmax's
normaliser and contributes no value (`document_attention.attend`); a rank holds its heads' sinks. Under context
parallelism every rank's queries see the whole gathered row of keys in one call, so each sink joins each
query's normaliser once.
Qwen3.5 (`cfg.attn_output_gate`) gates the attention output elementwise by sigmoid of a second half of each
query head's rows, `[q_h; gate_h]` (so the gate is split over TP with its head).

Gemma 4's full-attention layers have a shape of their own (`ModelConfig.attention_shape`): wider heads, fewer
KV heads, and with `attention_k_eq_v` no value projection: the fused weight is `[q heads of g; k_g]` per group and
the values are the raw keys (before the key norm and RoPE), each then RMS-normalised (`v_norm`). KV replication
is decided per layer with the layer's own KV heads, so a full-attention layer may replicate where the sliding
ones do not; keys-as-values replicate as k_g alone (the shared rows are its key rows).

Gemma 4's KV sharing (the E2B and E4B, `ModelConfig.kv_source`): the last `num_kv_shared_layers` layers compute
queries only and attend with the keys and values of the last earlier layer of their type, as that layer attended
with them (normed, rotated, gathered under CP). The chunk's forward passes one `kv_store` dict through its layers:
a producing layer puts its keys and values there, a reusing one reads them; autograd sums both uses' gradients
into the producer's projection. A reusing layer's fused weight is its q rows alone (no KV rows, so nothing to
replicate over TP), and its heads' groups are the producer's. A reader on a later pipeline stage than its producer
gets them with the activations (`models/shared_kv.py`).

A layer with a sliding window (`cfg.window`) attends under the micro-batch's windowed mask
(`DocumentMask.sliding`, document_attention.py), the others under its full one.

A layer without RoPE (SmolLM3's NoPE layers, `cfg.uses_rope`) skips the rotation and attends
with the raw Q and K; the decoder's one cos/sin table serves the other layers.

Selective recompute checkpoints only the core (`_core`: RoPE + attention), as
Megatron does: the QKV and output projections, and their TP/SP collectives, run
once; backward keeps the fused QKV output and the core's output and recomputes the
rotated Q/K and the attention itself.

Context parallelism (parallel/context.py): a rank's queries are its own tokens; the
rotated K and V of every CP rank are all-gathered (one collective, stacked) and the
queries attend over the whole row under the split mask the chunk planned.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import ModelConfig
from ..parallel.context import gather_kv
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..parallel.roles import ParamRole, add_param
from ..parallel.splits import Fused
from ..parallel.state import ParallelState
from .document_attention import DocumentMask, attend, layer_mask
from .kernels import Kernels
from .norm import HeadsRMSNorm, RMSNorm


def qkv_split(cfg: ModelConfig, layer: int | None) -> Fused:
    """Layer `layer`'s fused QKV rows as a split kind: the HF q, k (, v) rows, `[q heads of g; k_g; v_g]` (or
    `[q heads of g; k_g]`) per KV group g (`parallel/splits.py`; conversion and the adapters read it too)."""
    a = cfg.attention_shape(layer)
    sizes = [cfg.num_heads * cfg.q_rows_of(layer)] + [a.num_kv_heads * a.head_dim] * a.kv_parts
    # a layer reusing an earlier layer's K/V (Gemma 4's KV sharing) has query rows only: plain rows, no copies
    return Fused(tuple(sizes), a.num_kv_heads if a.kv_parts else None)


class ParallelAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, layer: int, kernels: Kernels):
        super().__init__()
        self.cfg, self.kernels, self.ps = cfg, kernels, ps
        shape = self.shape = cfg.attention_shape(layer)
        self.groups = cfg.local_kv_heads(ps.tp, layer)  # KV groups on this rank
        self.rep = cfg.num_heads // ps.tp // self.groups  # query heads per KV head on this rank
        self.scale = cfg.attn_scale(layer)
        self.rotates = cfg.uses_rope(layer)
        self.window = cfg.window(layer)
        d = self.d = shape.head_dim
        self.q_rows = cfg.q_rows_of(layer)
        self.layer, self.stores = layer, cfg.stores_kv(layer)
        self.kv_from = cfg.kv_source[layer] if cfg.reuses_kv(layer) else None  # KV sharing: whose keys, values
        split = qkv_split(cfg, layer)
        shared_rows, shared_by = split.copies(ps.tp)  # a group's key (and value) rows where KV heads are replicated
        self.qkv = ColumnParallelLinear(cfg.hidden_size, split.local_rows(ps.tp) * ps.tp, ps, bias=cfg.qkv_bias,
                                        shared_rows=shared_rows, shared_by=shared_by)
        self.out = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, ps, bias=cfg.out_bias)
        if cfg.qk_norm and cfg.qk_norm_whole:
            self.q_norm = HeadsRMSNorm(cfg.num_heads, d, cfg.norm_eps, ps)
            self.k_norm = HeadsRMSNorm(shape.num_kv_heads, d, cfg.norm_eps, ps)
        elif cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg, True, kernels)
            if not shape.reused:
                self.k_norm = RMSNorm(d, cfg, True, kernels)
        if cfg.attn_sinks:  # one logit per query head: TP-sharded with the heads (a rank's are contiguous)
            add_param(self, "sinks", cfg.num_heads // ps.tp, role=ParamRole("bias", tp_dim=0))
        else:
            self.sinks = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, docs: DocumentMask | None,
                recompute_core: bool = False, kv_store: dict | None = None):
        """`kv_store`: the keys and values of the layers that later layers attend with, by layer (KV sharing)."""
        qkv = self.qkv(x)  # [s, b, groups * (rep + 2) * d]
        s = qkv.shape[0] * self.ps.cp  # the row's length: under CP the queries are a part of it
        docs = layer_mask(docs, self.window, s)
        if recompute_core:
            o = checkpoint(self._core, qkv, rope, docs, kv_store, use_reentrant=False)
        else:
            o = self._core(qkv, rope, docs, kv_store)
        return self.out(o)

    def _core(self, qkv: torch.Tensor, rope, docs: DocumentMask | None, kv_store: dict | None = None) -> torch.Tensor:
        s, b = qkv.shape[:2]
        d, kv_parts = self.d, self.shape.kv_parts
        per_q = self.q_rows // d  # 2 with an output gate: each query head's rows are [q_h; gate_h]
        qkv = qkv.view(s, b, self.groups, self.rep * per_q + kv_parts, d).permute(1, 2, 3, 0, 4)  # [b, g, rep+2, s, d]
        # One split, not three slices: a slice's backward zero-fills a gradient the size of the whole QKV
        # output and copies its part in; split's backward concatenates the three parts once.
        q, *kv = qkv.split([self.rep * per_q] + [1] * kv_parts, dim=2)
        gate = None
        if per_q == 2:
            q, gate = q.unflatten(2, (self.rep, 2)).unbind(3)
            gate = gate.reshape(b, self.groups * self.rep, s, d)
        q = q.reshape(b, self.groups * self.rep, s, d)
        if self.cfg.qk_norm:
            q = self.q_norm(q)
        if rope is not None and self.rotates:
            cos, sin, *query_scale = rope
            q = self.kernels.rope(q, cos, sin)
            if query_scale:  # Ministral 3's per-position query scale (`rope.RotaryEmbedding`)
                q = q * query_scale[0]
        if self.kv_from is not None:  # the producing layer's, normed, rotated and gathered as it attended with them
            k, v = kv_store[self.kv_from]
        else:
            k, v = self._keys_values(kv, rope)
            if self.stores:
                kv_store[self.layer] = k, v
        o = attend(q, k, v, docs, self.scale, gqa=self.rep > 1, softcap=self.cfg.attn_softcap, sinks=self.sinks)
        if gate is not None:  # Qwen3.5's gated attention
            o = o * torch.sigmoid(gate)
        return o.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, heads_local * d]

    def _keys_values(self, kv: list[torch.Tensor], rope) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values `[b, groups, s, d]` from their fused rows (the values: the raw keys where
        `values_from_keys`), normed, the keys rotated, the whole row's under context parallelism."""
        k = kv[0].squeeze(2)
        v = kv[1].squeeze(2) if len(kv) > 1 else k
        if self.cfg.qk_norm:
            k = self.k_norm(k)
        if self.cfg.v_norm:
            v = self.kernels.rms_norm_fp32(v, None, self.cfg.norm_eps)
        if rope is not None and self.rotates:
            k = self.kernels.rope(k, rope[0], rope[1])
        return gather_kv(k, v, self.ps)
