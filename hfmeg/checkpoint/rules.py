"""How each hfmeg tensor is made from HF tensors, and back: the one key table.

Every parameter of a model chunk has a `TensorRule`: its hfmeg name, the HF names
it is built from, and a split kind. `to_local` builds one TP rank's slice from the
full HF tensors; `to_hf` rebuilds the HF tensors from all TP slices. Both are pure
data movement (cat/split/reshape/transpose/pad), so HF -> shards -> HF is bit-exact.
Loading, conversion and resharding all go through these two functions. Which rules
a model has, with which HF names, is its family's (`hfmeg/families`, `layer_rules`
and the names around the layers); this module only assembles and applies them.

Split kinds:
- `replicated`: norms, biases after a row-parallel reduction, learned positions.
- `rows`: split dim 0 (column-parallel output features, e.g. GPT-2 `c_fc`).
- `cols`: split dim 1 (row-parallel input features: `o_proj`, `down_proj`).
- `qkv`: Q, K, V fused per KV group, `[q heads of group g; k_g; v_g]` for each g,
  then split dim 0 so each rank owns whole groups (and GQA needs no communication).
  From three HF tensors, or from one HF tensor of `[q; k; v]` rows (GPT-2's `c_attn`,
  Phi-3's `qkv_proj`), cut by their sizes (q: heads x d rows, k and v: kv heads x d each).
  The KV heads and d are the rule's layer's (`ModelConfig.attention_shape(rule.layer)`); a layer whose values
  are its keys (Gemma 4's `attention_k_eq_v`) fuses two, `[q heads of g; k_g]`.
  With fewer KV heads than TP ranks (counted per layer), the `n = TP / KV` ranks of group g each hold
  `[their n-th of group g's q rows; k_g; v_g]` (or `[...; k_g]`; copies of k_g, v_g); back to HF, the q rows
  are concatenated and k_g, v_g are taken from the group's first rank.
- `gate_up`: gate and up each split dim 0, then `[gate_r; up_r]` on rank r; from two HF
  tensors, or from one of `[gate; up]` rows (Phi-3's `gate_up_proj`), cut in halves.
- `vocab`: rows padded with zeros to the padded vocabulary, then split dim 0.
- `fused`: several HF tensors concatenated along dim 0, whole on every TP rank (an
  MoE expert's `[gate; up]`: experts are not TP-split, see `models/moe.py`).
- `interleaved`: one HF tensor whose dim-0 entries alternate gate and up (gpt-oss's experts, after the
  transpose), whole on every TP rank as `[gate; up]`.
- `parts`: the HF tensors' rows, concatenated, cut into `rule.pieces` (Gated DeltaNet's q, k, v, z, b, a),
  each piece split dim 0 over TP, and rank r's slices of all pieces concatenated (`gate_up` is the case of
  two equal pieces). The HF tensors' shapes are the rule's `shapes`. With `rule.groups` each HF tensor holds
  its pieces grouped (`[group 0's share of each piece; group 1's; ...]`, Qwen3-Next's per-key-head layout): it is
  ungrouped to piece after piece first, and grouped again on the way back.

MoE layers (Mixtral `block_sparse_moe.*`, Qwen `mlp.*`: the family's `ExpertNames`) map the router (`gate`) and
every expert's tensors one to one, by expert index, so each tensor travels alone
(streaming) and the names carry the global expert index. The model holds a rank's
experts stacked (`models/moe.py` `GroupedExperts`), but the hfmeg names here, and so
the shard files, stay per expert (`layers.N.mlp.experts.E.fc1.weight`): each is one
slice of the stacked weight (`parallel/stored_names.py`). That keeps folders written
before the experts were stacked readable, and a folder written at any EP size holds
each expert once, so EP resharding needs nothing new. Their rules state the HF
shapes (`shapes`), which the split kind alone does not imply. A checkpoint that
stores the experts stacked, as transformers holds them in memory
(`mlp.experts.gate_up_proj` `[E, 2F, H]` = each expert's [gate; up], and
`mlp.experts.down_proj` `[E, H, F]`), has one rule per expert that takes index
`expert` of the stacked tensor; `MPCheckpoint` stacks the experts again on export, and
`rule_tensors` reads a stacked tensor once for all its experts.

GPT-2 stores its linear weights as `Conv1D` (`[in, out]`); `transpose=True` turns
them into `[out, in]` on the way in and back on the way out.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Collection, Iterable, Iterator

import torch

from ..config import ModelConfig
from ..families import spec_of
from ..families.llama import stacked_expert_names
from ..families.spec import TensorRule


def with_expert_layout(cfg: ModelConfig, names) -> ModelConfig:
    """`cfg` with `moe.fused_experts` read off the HF tensor names `names` (anything supporting `in`), for a family
    whose checkpoints may hold either layout (one naming its per-expert tensors: `FamilySpec.experts`); the others'
    (gpt-oss, Gemma 4) hold theirs stacked only, as their readers set."""
    if cfg.moe is None or not cfg.moe.sparse_layers or spec_of(cfg).experts is None:
        return cfg
    return with_fused_experts(cfg, stacked_expert_names(cfg.moe.sparse_layers[0])[0] in names)


def with_fused_experts(cfg: ModelConfig, fused: bool) -> ModelConfig:
    return replace(cfg, moe=replace(cfg.moe, fused_experts=fused)) if cfg.moe is not None else cfg


def chunk_rules(cfg: ModelConfig, layers: Iterable[int], pre_process: bool, post_process: bool,
                experts: Collection[int] | None = None) -> list[TensorRule]:
    """Rules for every parameter of a chunk holding `layers` (global indices), from the family's spec.

    `experts`: the routed experts (global indices) the chunk holds in its MoE layers, an
    expert-parallel rank's share (`ModelChunk.experts`); None: all of them."""
    family = spec_of(cfg)
    emb = family.embedding
    if experts is None and cfg.moe is not None:
        experts = range(cfg.moe.num_experts)
    rules: list[TensorRule] = []
    if pre_process:
        rules.append(TensorRule("embed.weight", (emb,), "vocab"))
        if cfg.positions == "learned":
            rules.append(TensorRule("pos_embed.weight", (family.position_embedding,), "replicated"))
        rules += family.first_stage(cfg)
    for i in layers:
        rules += family.layer_rules(cfg, i, experts)
    if post_process:
        rules.append(TensorRule("final_norm.weight", (family.final_norm + ".weight",), "replicated"))
        if cfg.norm == "layer":
            rules.append(TensorRule("final_norm.bias", (family.final_norm + ".bias",), "replicated"))
        if not cfg.tie_embeddings:
            rules.append(TensorRule("lm_head.weight", ("lm_head.weight",), "vocab"))
        elif not pre_process:
            rules.append(TensorRule("lm_head.weight", (emb,), "vocab", tied=True))
    return rules


def _qkv_fuse(cfg: ModelConfig, layer: int | None, parts: list[torch.Tensor]) -> torch.Tensor:
    """`[q heads of g; k_g; v_g]` (or `[q heads of g; k_g]`) for each KV group g, from the HF q, k (, v)."""
    g = cfg.attention_shape(layer).num_kv_heads
    rest = parts[0].shape[1:]
    return torch.cat([p.reshape(g, -1, *rest) for p in parts], dim=1).reshape(-1, *rest)


def _qkv_sizes(cfg: ModelConfig, layer: int | None) -> list[int]:
    """The rows of the HF q, k (, v) projections of layer `layer`."""
    a = cfg.attention_shape(layer)
    return [cfg.num_heads * cfg.q_rows_of(layer)] + [a.num_kv_heads * a.head_dim] * a.kv_parts


def _qkv_unfuse(cfg: ModelConfig, layer: int | None, fused: torch.Tensor) -> list[torch.Tensor]:
    g = cfg.attention_shape(layer).num_kv_heads
    rest = fused.shape[1:]
    per_group = [size // g for size in _qkv_sizes(cfg, layer)]
    return [p.reshape(-1, *rest) for p in fused.reshape(g, sum(per_group), *rest).split(per_group, dim=1)]


def _qkv_local(cfg: ModelConfig, layer: int | None, fused: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """TP rank `tp_rank`'s rows of layer `layer`'s fused QKV (whole groups; or, with replicated KV heads, its
    share of its group's q rows and the group's k and v, or k alone where the values are the keys)."""
    n = cfg.kv_replicas(tp, layer)
    if n == 1:
        return fused.chunk(tp, dim=0)[tp_rank]
    a = cfg.attention_shape(layer)
    block = fused.chunk(a.num_kv_heads, dim=0)[tp_rank // n]  # [q_g; k_g; v_g]
    kv = a.kv_parts * a.head_dim
    q, kv = block.split([block.shape[0] - kv, kv], dim=0)
    return torch.cat([q.chunk(n, dim=0)[tp_rank % n], kv], dim=0)


def _qkv_whole(cfg: ModelConfig, layer: int | None, shards: list[torch.Tensor]) -> torch.Tensor:
    """`_qkv_local`'s inverse: the fused QKV from every TP rank's rows (copies read from their first holder)."""
    n = cfg.kv_replicas(len(shards), layer)
    if n == 1:
        return torch.cat(shards, dim=0)
    a = cfg.attention_shape(layer)
    kv = a.kv_parts * a.head_dim
    blocks = []
    for g in range(a.num_kv_heads):
        holders = shards[g * n : (g + 1) * n]
        blocks += [s[: s.shape[0] - kv] for s in holders] + [holders[0][-kv:]]
    return torch.cat(blocks, dim=0)


def _tensor_pieces(rule: TensorRule) -> list[list[int]]:
    """The row counts of the pieces each HF tensor of a `parts` rule holds (its rows are whole pieces, in order)."""
    out, pieces = [], list(rule.pieces)
    for shape in rule.shapes:
        held = []
        while sum(held) < shape[0]:
            held.append(pieces.pop(0))
        out.append(held)
    return out


def _ungroup(t: torch.Tensor, pieces: list[int], groups: int) -> torch.Tensor:
    """Rows `[g: each piece's g-th share]` for g in groups -> `[piece 0; piece 1; ...]`."""
    rest = t.shape[1:]
    shares = t.reshape(groups, -1, *rest).split([p // groups for p in pieces], dim=1)
    return torch.cat([share.reshape(-1, *rest) for share in shares], dim=0)


def _group(t: torch.Tensor, pieces: list[int], groups: int) -> torch.Tensor:
    """`_ungroup`'s inverse."""
    rest = t.shape[1:]
    return torch.cat([p.reshape(groups, -1, *rest) for p in t.split(pieces, dim=0)], dim=1).reshape(-1, *rest)


def to_local(
    rule: TensorRule, hf: list[torch.Tensor], cfg: ModelConfig, tp: int, tp_rank: int, vocab_multiple: int = 128
) -> torch.Tensor:
    """This TP rank's slice of `rule.local`, from the full HF tensors named by `rule.hf`."""
    if rule.expert is not None:
        hf = [t[rule.expert] for t in hf]
    if rule.transpose:
        hf = [t.t() for t in hf]
    kind = rule.kind
    if kind == "replicated":
        out = hf[0]
    elif kind == "rows":
        out = hf[0].chunk(tp, dim=0)[tp_rank]
    elif kind == "cols":
        out = hf[0].chunk(tp, dim=1)[tp_rank]
    elif kind == "qkv":
        parts = hf if len(hf) > 1 else hf[0].split(_qkv_sizes(cfg, rule.layer), dim=0)
        out = _qkv_local(cfg, rule.layer, _qkv_fuse(cfg, rule.layer, list(parts)), tp, tp_rank)
    elif kind == "gate_up":
        gate, up = hf if len(hf) == 2 else hf[0].chunk(2, dim=0)
        out = torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
    elif kind == "fused":
        out = torch.cat(hf, dim=0)
    elif kind == "interleaved":
        out = torch.cat([hf[0][0::2], hf[0][1::2]], dim=0)
    elif kind == "parts":
        if rule.groups:
            hf = [_ungroup(t, pieces, rule.groups) for t, pieces in zip(hf, _tensor_pieces(rule))]
        out = torch.cat([p.chunk(tp, dim=0)[tp_rank] for p in torch.cat(hf, dim=0).split(rule.pieces, dim=0)])
    elif kind == "vocab":
        full = hf[0]
        padded = cfg.padded_vocab(tp, vocab_multiple)
        per = padded // tp
        out = full.new_zeros((per,) + tuple(full.shape[1:]))
        lo = tp_rank * per
        n = max(0, min(per, full.shape[0] - lo))
        out[:n] = full[lo : lo + n]
        return out
    else:
        raise ValueError(f"unknown split kind {kind!r} for {rule.local}")
    return out.contiguous()


def rule_tensors(source, rules: Iterable[TensorRule]) -> Iterator[tuple[TensorRule, list[torch.Tensor]]]:
    """(rule, the full HF tensors it is made from) for each rule, read from `source` by name.

    Consecutive rules made from the same HF tensors (the experts of one stacked tensor)
    share one read.
    """
    names, tensors = None, []
    for rule in rules:
        if rule.hf != names:
            names, tensors = rule.hf, [source.get(n) for n in rule.hf]
        yield rule, tensors


def to_hf(rule: TensorRule, shards: list[torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The HF tensors named by `rule.hf`, rebuilt from all TP slices (in TP-rank order).

    For an `expert` rule that is the expert's slice of the stacked tensor; the caller stacks."""
    if rule.tied:
        return {}
    kind = rule.kind
    if kind == "replicated":
        outs = [shards[0]]
    elif kind == "rows":
        outs = [torch.cat(shards, dim=0)]
    elif kind == "cols":
        outs = [torch.cat(shards, dim=1)]
    elif kind == "qkv":
        parts = _qkv_unfuse(cfg, rule.layer, _qkv_whole(cfg, rule.layer, shards))
        outs = parts if len(rule.hf) > 1 else [torch.cat(parts, dim=0)]
    elif kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        outs = [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
        outs = outs if len(rule.hf) == 2 else [torch.cat(outs, dim=0)]
    elif kind == "vocab":
        outs = [torch.cat(shards, dim=0)[: cfg.vocab_size]]
    elif kind == "fused":
        outs = list(shards[0].chunk(len(rule.hf), dim=0))
    elif kind == "interleaved":
        outs = [torch.stack(shards[0].chunk(2, dim=0), dim=1).flatten(0, 1)]
    elif kind == "parts":
        tp = len(shards)
        slices = [s.split([p // tp for p in rule.pieces], dim=0) for s in shards]
        whole = torch.cat([torch.cat([rank[i] for rank in slices], dim=0) for i in range(len(rule.pieces))], dim=0)
        outs = list(whole.split([shape[0] for shape in rule.shapes], dim=0))
        if rule.groups:
            outs = [_group(t, pieces, rule.groups) for t, pieces in zip(outs, _tensor_pieces(rule))]
    else:
        raise ValueError(f"unknown split kind {kind!r} for {rule.local}")
    if rule.transpose:
        outs = [t.t() for t in outs]
    return {name: t.contiguous() for name, t in zip(rule.hf, outs)}


def expected_hf_shape(rule: TensorRule, index: int, cfg: ModelConfig) -> tuple[int, ...]:
    """The shape `config.json` implies for HF tensor `rule.hf[index]` (for input validation)."""
    if rule.shapes is not None:
        return rule.shapes[index]
    h, f, v = cfg.hidden_size, cfg.ffn_size, cfg.vocab_size
    q = cfg.num_heads * cfg.attention_shape(rule.layer).head_dim
    is_bias = rule.local.endswith(".bias")
    if rule.kind == "vocab":
        return (v, h)
    if rule.kind == "replicated":
        if rule.local == "pos_embed.weight":
            return (cfg.max_positions, h)
        return (h,)
    if rule.kind == "qkv":
        sizes = _qkv_sizes(cfg, rule.layer)
        out = (sum(sizes),) if len(rule.hf) == 1 else (sizes[index],)
    elif rule.kind == "gate_up":
        out = (f if len(rule.hf) == 2 else 2 * f,)
    elif rule.kind == "rows":
        out = (f,)
    else:  # cols: o_proj [h, q], down/c_proj [h, f]
        inner = q if ".attn." in rule.local else f
        return (inner, h) if rule.transpose else (h, inner)
    if is_bias:
        return out
    return (h, out[0]) if rule.transpose else (out[0], h)
