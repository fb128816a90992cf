"""How each hfmeg tensor is made from HF tensors, and back: the one key table.

Every parameter of a model chunk has a `TensorRule`: its hfmeg name, the HF names
it is built from, and a split kind. `to_local` builds one TP rank's slice from the
full HF tensors; `to_hf` rebuilds the HF tensors from all TP slices. Both are pure
data movement, so HF -> shards -> HF is bit-exact, and both are two steps: the HF tensors,
put part after part (`torch.cat` of their rows), are the one full tensor that the rule's split
kind (`parallel/splits.py`, `split_of`) cuts into the TP slices and joins again.
Loading, conversion and resharding all go through these two functions. Which rules
a model has, with which HF names, is its family's (`hfmeg/families`, `layer_rules`
and the names around the layers); this module only assembles and applies them.

A rule's `kind` names its split kind:
- `replicated`: norms, biases after a row-parallel reduction, learned positions (`REPLICATED`).
- `rows`: split dim 0 (column-parallel output features, e.g. GPT-2 `c_fc`) (`ROWS`).
- `cols`: split dim 1 (row-parallel input features: `o_proj`, `down_proj`) (`COLS`).
- `qkv`: Q, K, V fused per KV group (`models/attention.py` `qkv_split`: `Fused` with the layer's KV heads as
  groups, replicated over TP where the layer has fewer KV heads than TP ranks), from three HF tensors (two where
  the layer's values are its keys, Gemma 4's `attention_k_eq_v`), or from one of `[q; k; v]` rows (GPT-2's
  `c_attn`, Phi-3's `qkv_proj`).
- `gate_up`: gate and up (`Fused` of two equal parts, a block per rank: `[gate_r; up_r]` on rank r), from two HF
  tensors or from one of `[gate; up]` rows (Phi-3's `gate_up_proj`).
- `vocab`: rows padded with zeros to the padded vocabulary, then split dim 0 (`Vocab`).
- `fused`: several HF tensors concatenated along dim 0, whole on every TP rank (an
  MoE expert's `[gate; up]`: experts are not TP-split, see `models/moe.py`).
- `interleaved`: one HF tensor whose dim-0 entries alternate gate and up (gpt-oss's experts, after the
  transpose), whole on every TP rank as `[gate; up]` (the HF tensor's own layout is `Blocks` of one row).
- `parts`: the HF tensors' rows, concatenated, cut into `rule.pieces` (Gated DeltaNet's q, k, v, z, b, a), each
  piece split dim 0 over TP (`Fused` of the pieces; `gate_up` is the case of two equal pieces). The HF tensors'
  shapes are the rule's `shapes`. With `rule.groups` each HF tensor holds its pieces grouped (`[group 0's share
  of each piece; group 1's; ...]`, Qwen3-Next's per-key-head layout, `Blocks` of `groups`): it is ungrouped to
  piece after piece first, and grouped again on the way back.

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

from ..config import VOCAB_MULTIPLE, ModelConfig
from ..families import spec_of
from ..families.llama import stacked_expert_names
from ..families.spec import TensorRule
from ..models.attention import qkv_split
from ..parallel.splits import COLS, REPLICATED, ROWS, Blocks, Fused, Split, Vocab


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


def _tensor_pieces(rule: TensorRule) -> list[list[int]]:
    """The row counts of the pieces each HF tensor of a `parts` rule holds (its rows are whole pieces, in order)."""
    out, pieces = [], list(rule.pieces)
    for shape in rule.shapes:
        held = []
        while sum(held) < shape[0]:
            held.append(pieces.pop(0))
        out.append(held)
    return out


def hf_parts(rule: TensorRule, split: Fused) -> list[tuple[int, ...]]:
    """The parts of a fused rule's split kind that each of its HF tensors holds (indices, in order)."""
    if len(rule.hf) == 1:
        return [tuple(range(len(split.sizes)))]
    counts = [len(pieces) for pieces in _tensor_pieces(rule)] if rule.pieces else [1] * len(rule.hf)
    starts = [sum(counts[:k]) for k in range(len(counts))]
    return [tuple(range(a, a + c)) for a, c in zip(starts, counts)]


def split_of(rule: TensorRule, cfg: ModelConfig, vocab_multiple: int | None = None) -> Split:
    """The split kind of `rule.local` over TP (`vocab_multiple`: the padding step, needed to shard a `vocab` rule)."""
    kind = rule.kind
    if kind == "qkv":
        return qkv_split(cfg, rule.layer)
    if kind == "gate_up":
        return Fused((_gate_up_rows(rule, cfg),) * 2)
    if kind == "parts":
        return Fused(tuple(rule.pieces))
    if kind == "vocab":
        return Vocab(cfg.vocab_size, vocab_multiple)
    if kind not in _PLAIN:
        raise ValueError(f"unknown split kind {kind!r} for {rule.local}")
    return _PLAIN[kind]


def _gate_up_rows(rule: TensorRule, cfg: ModelConfig) -> int:
    """The rows of each of a gate/up pair (from the HF shapes, so a layer of its own width is read right)."""
    rows = sum(expected_hf_shape(rule, i, cfg)[1 if rule.transpose else 0] for i in range(len(rule.hf)))
    return rows // 2


# `fused`: several HF tensors concatenated, whole on every rank; `interleaved`: one HF tensor of alternating rows
_PLAIN = {"replicated": REPLICATED, "fused": REPLICATED, "interleaved": REPLICATED, "rows": ROWS, "cols": COLS}


def _hf_layouts(rule: TensorRule, hf_rows: list[int]) -> list[Blocks | None]:
    """How each HF tensor holds its rows where not part after part: gpt-oss's alternating gate/up rows, the
    groups of a grouped `parts` rule."""
    if rule.kind == "interleaved":
        return [Blocks(hf_rows[0] // 2, (hf_rows[0] // 2,) * 2)]
    if rule.kind == "parts" and rule.groups:
        return [Blocks(rule.groups, tuple(pieces)) for pieces in _tensor_pieces(rule)]
    return [None] * len(hf_rows)


def _hf_rows(rule: TensorRule, cfg: ModelConfig, rows: int) -> list[int]:
    """The rows of each HF tensor of `rule` within the full tensor of `rows` rows it makes."""
    if len(rule.hf) == 1:
        return [rows]
    if rule.kind == "qkv":
        return list(qkv_split(cfg, rule.layer).sizes)
    if rule.kind == "parts":
        return [shape[0] for shape in rule.shapes]
    return [rows // len(rule.hf)] * len(rule.hf)


def to_local(
    rule: TensorRule, hf: list[torch.Tensor], cfg: ModelConfig, tp: int, tp_rank: int,
    vocab_multiple: int = VOCAB_MULTIPLE
) -> torch.Tensor:
    """This TP rank's slice of `rule.local`, from the full HF tensors named by `rule.hf`: the HF tensors put
    part after part into the one full tensor the rule's split kind cuts."""
    if rule.expert is not None:
        hf = [t[rule.expert] for t in hf]
    if rule.transpose:
        hf = [t.t() for t in hf]
    return split_of(rule, cfg, vocab_multiple).shard(parts_in_order(rule, hf), tp, tp_rank).contiguous()


def slice_shape(rule: TensorRule, cfg: ModelConfig, hf_shapes: list[tuple[int, ...]], tp: int,
                vocab_multiple: int = VOCAB_MULTIPLE) -> tuple[int, ...]:
    """The shape `to_local` gives each TP slice of `rule.local` from HF tensors of shapes `hf_shapes`, from the
    shapes alone, as `hf_shape` inverts it: the rows of the HF tensors part after part (`parts_in_order` moves
    rows, not shapes), cut by the split kind (`Split.local_shape`). Not run on meta tensors: the first `torch.cat`
    of meta tensors imports torch._dynamo, torch._inductor and sympy (1.4 s of CPU in a conversion, which needs
    none of them)."""
    shapes = [s[1:] if rule.expert is not None else s for s in map(tuple, hf_shapes)]
    if rule.transpose:
        shapes = [s[::-1] for s in shapes]
    full = (sum(s[0] for s in shapes), *shapes[0][1:])
    return tuple(split_of(rule, cfg, vocab_multiple).local_shape(full, tp))


def parts_in_order(rule: TensorRule, hf: list[torch.Tensor]) -> torch.Tensor:
    """The rows of the HF tensors (or of anything indexed by their rows) part after part: the full tensor the
    rule's split kind cuts."""
    layouts = _hf_layouts(rule, [t.shape[0] for t in hf])
    hf = [t if layout is None else layout.deinterleave(t) for t, layout in zip(hf, layouts)]
    return hf[0] if len(hf) == 1 else torch.cat(hf, dim=0)


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
    full = split_of(rule, cfg).join(shards)
    rows = _hf_rows(rule, cfg, full.shape[0])
    outs = list(full.split(rows, dim=0)) if len(rows) > 1 else [full]
    outs = [t if layout is None else layout.interleave(t) for t, layout in zip(outs, _hf_layouts(rule, rows))]
    if rule.transpose:
        outs = [t.t() for t in outs]
    return {name: t.contiguous() for name, t in zip(rule.hf, outs)}


def hf_shape(rule: TensorRule, name: str, local: tuple[int, ...], tp: int, cfg: ModelConfig) -> tuple[int, ...]:
    """The shape `to_hf` gives HF tensor `name` of `rule` from TP slices of shape `local`, from the shapes alone:
    the split kind's full shape, cut into the rule's HF tensors, transposed where the rule is (interleaving moves
    rows, not shapes). An export asks it of every tensor each time, so it computes no tensor, not even on meta."""
    full = split_of(rule, cfg).full_shape(tuple(local), tp)
    shape = (_hf_rows(rule, cfg, full[0])[rule.hf.index(name)], *full[1:])
    return shape[::-1] if rule.transpose else shape


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
        sizes = qkv_split(cfg, rule.layer).sizes
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
