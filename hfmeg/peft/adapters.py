"""LoRA adapters on the tensor-parallel layers, and the table that names their tensors in PEFT's format.

For a base layer `y = W x`, LoRA adds `scale * B A dropout(x)` with `A` `[r, in]`,
`B` `[out, r]` trained and `W` frozen; DoRA also trains a magnitude per output feature
(`LoraAdapter`). On the TP layers (the consensus layout):

- column-parallel base (`W` split along the output): `A` is whole on every TP rank and
  `B` is split along the output like `W`, so each rank adds its own output features
  and nothing is communicated. `A`'s gradient is `sum_out B^T g x^T` over this rank's
  outputs only, a partial sum, so its role is `sequence_parallel` (summed over TP by
  the gradient machinery, `parallel/roles.py`).
- row-parallel base (`W` split along the input): `A` is split along the input like
  `W`, and `B` is whole. `B (A_r x_r)` is this rank's partial output, added to the
  base's partial output before the one reduction that sums both (`parallel/layers.py`);
  `B`'s gradient sees only `A_r x_r`, so it is partial too (`sequence_parallel`).

Megatron fuses HF projections into one base (QKV per KV group, gate/up); each HF
projection keeps an adapter of its own (`q_proj`, `k_proj`, `v_proj`; `gate_proj`,
`up_proj`), so an export gives each of them exactly its A and B. The fused output is
rebuilt in the base's local order: per KV group `[q heads; k; v]`, `[gate; up]`, with
zeros for a projection not targeted. Every base's adapters are derived from its conversion rule
(`checkpoint/rules.py`, `_bases`): one projection per HF tensor the rule reads, whose B rows (and DoRA's magnitudes) are
split over TP like that tensor's parts of the base's split kind (`Fused.select`, `parallel/splits.py`). Where TP
exceeds a layer's KV heads (the base holds copies of its group's K/V rows, `models/attention.py`), `k_proj`'s and
`v_proj`'s B rows are copies the same way: one trained tensor whose holders each have a part of its gradient (from
their own query heads), summed over them and counted once in the norm (the role's `shared_rows`, from
`Split.copies`), joined from the group's first holder on export; A, whole, is partial over TP as ever. So a family
whose HF checkpoints fuse them too (Phi-3's `qkv_proj`, `gate_up_proj`) has, as in peft, one A and one B over all
the fused rows, laid out like the base's (parts cut into blocks and interleaved, per KV group or per TP rank, then
split over TP) and put back in peft's order on export; Qwen3.5's Gated DeltaNet in_proj (`in_proj_qkv`,
`in_proj_z`, `in_proj_b`, `in_proj_a`) has one adapter per HF projection, `in_proj_qkv`'s B interleaved by TP rank
as its q, k and v rows are in the base.

Every adapter tensor is one HF tensor (`AdapterTensor.hf`, PEFT's key) cut by one split kind
(`AdapterTensor.split`): B as said, A of a column-parallel base whole (`REPLICATED`), of a row-parallel base split
like the base's input (`COLS`) with B whole. A fresh `A` is
drawn as `peft` draws it (Kaiming-uniform, a = sqrt(5)) in its full HF shape from a
generator seeded by the run seed and the tensor's name, then sliced, so every layout
starts from the same adapter; `B` starts at zero, so the model starts as the base.

MoE models (Mixtral, Qwen3-MoE). transformers v5 holds a layer's experts stacked
(`mlp.experts.gate_up_proj` `[E, 2F, H]`, `down_proj` `[E, H, F]`) and `peft` (0.21) adapts
them with LoRA on those parameters (`ParamWrapper`): per expert e an `A_e` `[r, in]` and a
`B_e` `[out, r]`, kept in two PEFT tensors, `lora_A` `[E r, in]` (expert-major rows) and
`lora_B` `[out, r E]` (column `k E + e` is expert e's column k). hfmeg's grouped experts
(`models/moe.py`) are the same stacks per EP rank, so each targeted one gets an `ExpertLora`:
A `[E_local, r, in]` and B `[E_local, out, r]` of this rank's experts, role `expert` +
`adapter` (reduced over expert-DP like the experts), applied to the expert-sorted rows as
two more grouped GEMMs. On disk each expert's A and B are tensors of their own under
their global index (`parallel/stored_names.py`), so EP resharding and resumes move them
one by one; the export stacks them into peft's two tensors (kinds `EXPERT_ROWS` and `EXPERT_COLS` over the experts).
The router (`gate.weight`) gets a plain LoRA held whole on every TP rank (its input is the
rank's token share: both factors' gradients are partial, `sequence_parallel`). In
`modules_to_save` instead (`gate`), the router's own weight trains in full, its role already
`sequence_parallel`, and is saved whole under peft's key `...mlp.gate.weight`.

Qwen2-MoE's shared expert (`models/moe.py` `GatedExpert`: `fc1` = [gate; up], `fc2`, and the
1-output `shared_gate`, all `ReplicatedLinear`s that see this rank's tokens) gets the same
`LoraAdapter` as a dense MLP, one `LoraPair` per HF projection (`shared_expert.gate_proj`,
`up_proj`, `down_proj`, and `shared_expert_gate`), but every factor whole and partial
(`sequence_parallel`), like the router's.
"""

from __future__ import annotations

import math
import zlib
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from ..checkpoint.rules import chunk_rules, expected_hf_shape, hf_parts, split_of
from ..errors import CheckpointError, UnsupportedConfigError
from ..models.decoder import ModelChunk
from ..models.grouped_linear import grouped_linear
from ..models.moe import MoELayer
from ..parallel.roles import ParamRole, add_param
from ..parallel.splits import COLS, EXPERT_COLS, EXPERT_ROWS, REPLICATED, ROWS, Fused, Split, Vocab
from ..parallel.state import ParallelState
from ..parallel.stored_names import set_stored_names, stored_tensors
from ..families import spec_of, text_config
from ..families.deepseek_v3 import LATENT_A, QUERY, QUERY_LATENT
from ..families.llama import ATTENTION, layer_prefix
from ..families.qwen2_moe import SHARED_GATE
from .config import ALL_LINEAR, EXPERT_PARAMS, MOE_SAVABLE, SAVABLE, PeftConfig

PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class Projection:
    """One HF projection inside a base layer: its name, HF module path, full output size and the split kind of its
    output rows over TP (its part(s) of the base's kind, `Fused.select`: its B rows and DoRA magnitudes are laid
    out like them)."""
    name: str
    module: str  # HF module path, e.g. model.layers.3.self_attn.q_proj
    out_features: int
    rows: Split = ROWS


@dataclass(frozen=True)
class AdapterTensor:
    local: str  # the chunk's parameter name
    hf: str  # PEFT's key in adapter_model.safetensors
    split: Split  # how the full HF tensor is cut over TP ranks, or over experts (`expert`)
    expert: tuple[int, int] | None = None  # (e, E): expert e's piece of peft's stack of E

    def shard(self, full: torch.Tensor, ps: ParallelState) -> torch.Tensor:
        """This rank's piece of the full HF tensor (expert e's, for an expert's tensor)."""
        parts, index = (self.expert[1], self.expert[0]) if self.expert else (ps.tp, ps.tp_rank)
        return self.split.shard(full, parts, index)

    def full_shape(self, local: tuple[int, ...], tp: int) -> tuple[int, ...]:
        return self.split.full_shape(local, self.expert[1] if self.expert else tp)


class InputDropout(nn.Module):
    """Dropout on an adapter's input whose mask does not depend on the TP layout.

    The mask is drawn for the full input features from the rank's generator (the same
    state on every TP rank: the trainer seeds them alike) and, for a row-parallel base
    whose input is split, this rank's columns of it are used. So every TP rank of a
    column-parallel base drops the same elements, a row-parallel base's shards drop
    disjoint parts of one full mask, and a TP2 run draws exactly the masks a TP1 run
    does, like `peft`'s one `nn.Dropout` over the whole input."""

    def __init__(self, p: float, tp: int, tp_rank: int, split_input: bool):
        super().__init__()
        self.p, self.parts, self.part = p, (tp if split_input else 1), (tp_rank if split_input else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        full = x.new_empty(*x.shape[:-1], x.shape[-1] * self.parts).bernoulli_(1 - self.p)
        return x * full.chunk(self.parts, dim=-1)[self.part] / (1 - self.p)


class LoraPair(nn.Module):
    """A and B of one HF projection (and DoRA's magnitude), sliced for this TP rank as the module docstring says."""

    def __init__(self, in_local: int, out_local: int, out_full: int, r: int, column: bool, cfg: PeftConfig,
                 ps: ParallelState, replicated: bool = False, whole_partial: bool = True,
                 copies: tuple[int, int] = (0, 1)):
        super().__init__()
        partial = ParamRole("weight", sequence_parallel=True, adapter=True)
        # B's rows (and DoRA's magnitudes) split like the base's: the last `copies[0]` a copy `copies[1]` ranks hold
        # where KV heads are replicated (`Split.copies`), whose gradients each holder has from its query heads only
        rows = ParamRole("weight", tp_dim=0, adapter=True, shared_rows=copies[0], shared_by=copies[1])
        split = {"A": ParamRole("weight", tp_dim=1, adapter=True), "B": rows}
        # a replicated base's factors: partial where its rank sees its own tokens only (`_Base.whole_partial`)
        whole = ParamRole("weight", sequence_parallel=whole_partial, adapter=True)
        add_param(self, "lora_A", r, in_local, role=whole if replicated else partial if column else split["A"])
        add_param(self, "lora_B", out_local, r, role=whole if replicated else split["B"] if column else partial)
        if cfg.method == "dora":  # one magnitude per output feature: split like B's rows, or whole and partial
            add_param(self, "lora_magnitude_vector", out_local if column else out_full,
                      role=rows if column else partial)
        self.dropout = InputDropout(cfg.dropout, ps.tp, ps.tp_rank, not column) if cfg.dropout > 0 else nn.Identity()

    @property
    def dora(self) -> bool:
        return hasattr(self, "lora_magnitude_vector")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B A dropout(x), dropout(x))."""
        dropped = self.dropout(x)
        return F.linear(F.linear(dropped, self.lora_A), self.lora_B), dropped


def _row_norm(w: torch.Tensor, column: bool, ps: ParallelState) -> torch.Tensor:
    """The norm of each output row of the full matrix whose local slice is `w` (a row-parallel slice
    holds only some columns of each row: the squared partial norms are summed over TP)."""
    sq = w.float().square().sum(dim=1)
    if not column and ps.tp > 1:
        dist.all_reduce(sq, group=ps.tp_group)
    return sq.sqrt().to(w.dtype)


class LoraAdapter(nn.Module):
    """The LoRA (or DoRA) update of one TP base layer: one `LoraPair` per targeted HF projection fused in it.

    `groups`: how many blocks the base's local output interleaves its projections in
    (`Fused.local_groups`: the local KV groups for QKV, 1 for gate/up or a single projection).

    DoRA (as `peft` computes it): with `n` the row norms of `W + scale B A` (no gradient:
    the DoRA paper's section 4.3) and `m` the trained magnitude, the output is
    `(m / n) (W x + scale B A x)`, added to the base's `W x` as
    `(m / n - 1) W x + (m / n) scale B A x`. Under TP a column-parallel base holds whole
    rows, so its `n` is local; a row-parallel base holds a slice of every row, so its
    squared row norms are summed over TP (`_row_norm`). Every term is linear in the
    rank's partial `W x` and `B A x`, so the base's one reduction still sums them.
    """

    def __init__(self, projections: list[Projection], targeted: set[str], in_local: int, column: bool,
                 groups: int, cfg: PeftConfig, ps: ParallelState, replicated: bool = False,
                 whole_partial: bool = True):
        super().__init__()
        self.groups, self.scale, self.column, self.ps = groups, cfg.scale, column, ps
        # whether `forward` reads the base's weight (DoRA's norms); else it is given None, and a 4-bit base need not
        # dequantize its weight whole (`parallel/layers.py`)
        self.reads_weight = cfg.method == "dora"
        split = column and not replicated  # `replicated`: a ReplicatedLinear base (the MoE router)
        # each projection's local rows, as its part(s) of the base's split kind cut them (copies included)
        self.widths = [(p.name, p.rows.local_shape((p.out_features,), ps.tp)[0] if split else p.out_features)
                       for p in projections]
        for p, (_, out_local) in zip(projections, self.widths):
            if p.name in targeted:
                self.add_module(p.name, LoraPair(in_local, out_local, p.out_features, cfg.r, column, cfg, ps,
                                                 replicated, whole_partial, p.rows.copies(ps.tp) if split else (0, 1)))

    def _blocks(self, t: torch.Tensor, dim: int) -> list[torch.Tensor]:
        """Each projection's part of the fused output features of `t` along `dim`, in `widths` order."""
        per_group = [w // self.groups for _, w in self.widths]
        parts = t.unflatten(dim, (self.groups, -1)).split(per_group, dim=dim + 1)
        return [part.flatten(dim, dim + 1) for part in parts]

    @torch.no_grad()
    def _norm(self, pair: LoraPair, w_p: torch.Tensor) -> torch.Tensor:
        """DoRA's `n`: the full row norms of `W + scale B A` for one projection (no gradient)."""
        return _row_norm(w_p + self.scale * (pair.lora_B @ pair.lora_A), self.column, self.ps)

    def forward(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        ys = self._blocks(y, y.dim() - 1)
        ws = self._blocks(weight, 0) if self.reads_weight else [None] * len(self.widths)
        out = []
        for (name, width), y_p, w_p in zip(self.widths, ys, ws):
            pair = getattr(self, name, None)
            if pair is None:
                out.append(x.new_zeros(*x.shape[:-1], width))
                continue
            lora, dropped = pair(x)
            if not pair.dora:
                out.append(lora * self.scale)
                continue
            ratio = pair.lora_magnitude_vector / self._norm(pair, w_p)
            if dropped is not x:  # the base term sees the dropped-out input too, as in peft
                y_p = F.linear(dropped, w_p)
            out.append((ratio - 1) * y_p + ratio * lora * self.scale)
        if len(out) == 1:
            return out[0]
        return torch.cat([t.unflatten(-1, (self.groups, -1)) for t in out], dim=-1).flatten(-2)

    @torch.no_grad()
    def reset_magnitudes(self, weight: torch.Tensor) -> None:
        """DoRA's initial magnitude: the row norms of `W + scale B A` (the update starts as plain LoRA's)."""
        for (name, _), w_p in zip(self.widths, self._blocks(weight, 0)):
            pair = getattr(self, name, None)
            if pair is not None and pair.dora:
                pair.lora_magnitude_vector.copy_(self._norm(pair, w_p))


_EXPERT_ADAPTER = ParamRole("weight", sequence_parallel=True, expert=True, adapter=True)


class ExpertLora(nn.Module):
    """LoRA on one stacked expert weight `[E_local, out, in]` of a rank's grouped experts: A `[E_local, r, in]`,
    B `[E_local, out, r]`, stored per expert as `{e}.lora_A`, `{e}.lora_B`. `forward(rows, offsets)` gives
    `scale B_e A_e x` for each expert's block of rows, as two grouped GEMMs (`models/grouped_linear.py`).
    No dropout: peft's LoRA on parameters has none (refused in `check_model`)."""

    def __init__(self, experts: range, r: int, in_features: int, out_features: int, scale: float):
        super().__init__()
        self.scale = scale
        add_param(self, "lora_A", len(experts), r, in_features, role=_EXPERT_ADAPTER)
        add_param(self, "lora_B", len(experts), out_features, r, role=_EXPERT_ADAPTER)
        for name in ("lora_A", "lora_B"):
            set_stored_names(self, name, [f"{e}.{name}" for e in experts])

    def forward(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return grouped_linear(grouped_linear(rows, self.lora_A, offsets), self.lora_B, offsets) * self.scale


def _moe_layers(chunk: ModelChunk) -> list[tuple[int, MoELayer]]:
    # The blocks that are a layer's MLP: Gemma 4's, beside its MLP, has no LoRA on its router or experts (not built)
    return [(int(i), layer.mlp) for i, layer in chunk.layers.items() if isinstance(layer.mlp, MoELayer)]


def _expert_keys(i: int, params: tuple[str, ...]) -> dict[str, str]:
    """PEFT key prefix of each targeted expert/router parameter of layer i: peft wraps gate_up_proj first, so
    with down_proj targeted too gate_up_proj's wrapper is the inner one (`experts.base_layer`)."""
    m = f"{PEFT_PREFIX}{layer_prefix(i)}mlp."
    keys = {"gate.weight": m + "gate.", "down_proj": m + "experts.",
            "gate_up_proj": m + ("experts.base_layer." if "down_proj" in params else "experts.")}
    return {p: keys[p] for p in params}


@dataclass(frozen=True)
class _Base:
    """A base layer of a decoder layer that can carry an adapter."""
    local: str  # module path in the chunk, e.g. layers.3.attn.qkv
    projections: list[Projection]
    column: bool
    groups: int = 1  # local output blocks (see LoraAdapter)
    replicated: bool = False  # a `ReplicatedLinear` (Qwen2-MoE's shared expert): whole on every TP rank
    # a replicated base's adapter gradients are partial over TP: true where each rank feeds it its own tokens (the
    # MoE block's), false for MLA's a-projections without SP (every rank all tokens, the full output gradient)
    whole_partial: bool = True


def _bases(chunk: ModelChunk) -> list[_Base]:
    """The base layers that can carry a plain adapter: attention, a dense layer's MLP (not on Mixtral / Qwen3-MoE,
    where peft maps the MLP names to the experts, which are `_moe_layers` with the router), Qwen2-MoE's shared
    expert and its gate; MLA's projections (`models/latent_attention.py`: the a-projections replicated, their
    adapter gradients partial over TP under SP only)."""
    cfg, tp, sp = chunk.cfg, chunk.ps.tp, chunk.ps.sequence_parallel
    experts_mapped = bool(spec_of(cfg).peft.experts)
    rules = {r.local: r for r in chunk_rules(cfg, [int(i) for i in chunk.layer_ids], False, False, chunk.experts)}

    def base(local: str, whole_partial: bool = True) -> _Base:
        """A base layer, from its conversion rule: one projection per HF tensor the rule reads (one over all where
        the checkpoint fuses them, as Phi-3's `qkv_proj`), its rows split like that tensor's part(s) of the base's
        split kind; column-parallel where the kind splits the rows, row-parallel where it splits the columns."""
        rule = rules[local + ".weight"]
        split = split_of(rule, cfg)
        fused = isinstance(split, Fused)
        parts = hf_parts(rule, split) if fused else [(k,) for k in range(len(rule.hf))]
        projections = []
        for k, (hf, held) in enumerate(zip(rule.hf, parts)):
            module = hf.removesuffix(".weight")
            rows = split.select(held) if fused else ROWS if split == ROWS else REPLICATED
            projections.append(Projection(module.rsplit(".", 1)[1], module, expected_hf_shape(rule, k, cfg)[0], rows))
        groups = split.local_groups(tp) if fused and len(projections) > 1 else 1
        return _Base(local, projections, split.tp_dim != 1, groups, split.tp_dim is None, whole_partial)

    out = []
    for i in chunk.layer_ids:
        L = f"layers.{i}."
        if cfg.is_linear(int(i)):  # Gated DeltaNet: in_proj fuses in_proj_qkv (its q, k, v pieces), z, b and a
            out.append(base(L + "attn.in_proj"))
        elif cfg.mla is None:  # the layer's shape (`attention_shape`): no v_proj where the values are the keys
            out.append(base(L + "attn.qkv"))
        else:
            q = [L + "attn.q"] if cfg.mla.q_lora_rank is None else [L + "attn.q_a", L + "attn.q_b"]
            out += [base(local, whole_partial=sp or not local.endswith("_a"))
                    for local in q + [L + "attn.kv_a", L + "attn.kv_b"]]
        out.append(base(L + "attn.out"))
        dense = not cfg.is_sparse(int(i)) or cfg.moe.beside_dense  # Gemma 4's dense MLP beside its experts
        if dense and not experts_mapped:
            out += [base(L + "mlp.fc1"), base(L + "mlp.fc2")]
        elif cfg.is_sparse(int(i)) and cfg.moe.shared_expert_ffn_size and not experts_mapped:
            out += [base(L + "mlp.shared.fc1"), base(L + "mlp.shared.fc2"), base(L + "mlp.shared_gate")]
    return out


def check_model(chunk_cfg, cfg: PeftConfig) -> None:
    """Refuse, naming the field, a model LoRA is not built for here (before any weight is read)."""
    names = spec_of(chunk_cfg).peft
    if names is None or not chunk_cfg.gated_mlp:
        raise UnsupportedConfigError(f"peft.method: {cfg.method} is built for LLaMA-family models (fused QKV, "
                                     f"gate/up); this is a {chunk_cfg.model_type} model")
    # peft keeps a module of modules_to_save as its own trained copy: on a tied model that unties the embedding
    # from the head at load, so the adapter would not give the model hfmeg trained (the one tied weight)
    tied = [m for m in ("embed_tokens", "lm_head") if m in cfg.modules_to_save] if chunk_cfg.tie_embeddings else []
    if tied:
        raise UnsupportedConfigError(f"peft.modules_to_save: {tied[0]} is tied to "
                                     f"{'lm_head' if tied[0] == 'embed_tokens' else 'embed_tokens'} in this model, "
                                     "and peft would load it as an untied copy, not the model trained; leave it out")
    _check_saved(chunk_cfg, cfg)
    wanted = set(cfg.target_modules) - {ALL_LINEAR}
    if chunk_cfg.mla is not None:
        _check_latent(chunk_cfg, cfg, names, wanted)
    if chunk_cfg.moe is None:
        unmatched = sorted(wanted - set(cfg.module_targets(names)))
    elif not names.experts:  # Qwen2-MoE, gpt-oss: peft's names are their nn.Linears only
        experts = sorted(wanted & ({"gate"} | set(EXPERT_PARAMS)) - set(names.modules))
        if experts:
            raise UnsupportedConfigError(f"peft.target_modules: {experts} on {chunk_cfg.model_type}: peft reaches its "
                                         "routed experts and router only through target_parameters (no v4-name "
                                         f"mapping for this model), which is not built; target {' '.join(names.modules)}")
        unmatched = sorted(wanted - set(names.modules))
        shared = set(cfg.module_targets(names)) - set(ATTENTION)
        if shared and (cfg.method == "dora" or cfg.dropout):
            field = "method: dora" if cfg.method == "dora" else "dropout"
            raise UnsupportedConfigError(f"peft.{field} is not supported on the shared expert ({sorted(shared)} are "
                                         "replicated layers fed each TP rank's own tokens; not proven there): target "
                                         "attention only")
    else:
        unmatched = sorted(wanted - set(names.modules) - set(names.experts) - set(names.experts.values()))
        pair = names.fused
        if len(wanted & set(pair)) == 1:
            raise UnsupportedConfigError(f"peft.target_modules: {sorted(wanted & set(pair))[0]} without "
                                         f"{sorted(set(pair) - wanted)[0]}: they are one fused gate_up_proj (as "
                                         "peft refuses it)")
        if cfg.moe_targets()[1]:
            if cfg.method == "dora":
                raise UnsupportedConfigError("peft.method: dora is not supported on MoE experts (nor on the router; "
                                             "peft's LoRA on parameters has no DoRA): target attention only")
            if cfg.dropout:
                raise UnsupportedConfigError("peft.dropout: must be 0 with MoE experts or the router targeted "
                                             "(peft's LoRA on parameters has no dropout)")
    if unmatched:
        raise UnsupportedConfigError(f"peft.target_modules: {unmatched} match nothing in this "
                                     f"{chunk_cfg.model_type} model")


def _check_latent(chunk_cfg, cfg: PeftConfig, names, wanted: set[str]) -> None:
    """MLA: the query projections the model lacks (`q_proj` beside a query latent, or the latent's without one), and
    DoRA or dropout on the replicated a-projections (not built there, as on Qwen2-MoE's shared expert), refused."""
    absent = sorted(wanted & ({QUERY} if chunk_cfg.mla.q_lora_rank else set(QUERY_LATENT)))
    if absent:
        raise UnsupportedConfigError(f"peft.target_modules: {absent} match nothing in this {chunk_cfg.model_type} "
                                     f"model (q_lora_rank {chunk_cfg.mla.q_lora_rank})")
    replicated = sorted(set(cfg.module_targets(names)) & set(LATENT_A))
    if replicated and (cfg.method == "dora" or cfg.dropout):
        field = "method: dora" if cfg.method == "dora" else "dropout"
        raise UnsupportedConfigError(f"peft.{field} is not supported on {replicated} (replicated layers, whole on "
                                     "every TP rank; not built there): target the other projections")


def _check_saved(chunk_cfg, cfg: PeftConfig) -> None:
    """Refuse a `modules_to_save` an MoE module name the model lacks or a LoRA adapts too (peft refuses both)."""
    moe = [m for m in cfg.modules_to_save if m in MOE_SAVABLE]
    if not moe:
        return
    shared = chunk_cfg.moe is not None and bool(chunk_cfg.moe.shared_expert_ffn_size)
    # gpt-oss's router is `mlp.router`, with a bias: not the `gate` peft's suffix match would save
    absent = [m for m in moe if chunk_cfg.moe is None or (m == SHARED_GATE and not shared)
              or (m == "gate" and chunk_cfg.moe.router_bias)]
    if absent:
        raise UnsupportedConfigError(f"peft.modules_to_save: {absent[0]} is not a module of this "
                                     f"{chunk_cfg.model_type} model")
    names = spec_of(chunk_cfg).peft
    lora = set(cfg.moe_targets()[1] if names.experts else ())
    lora |= set(cfg.module_targets(names)) & {SHARED_GATE}
    saved = {"gate.weight"} if "gate" in moe else set()
    saved |= {SHARED_GATE} if shared and moe else set()  # peft's suffix match: `gate` takes shared_expert_gate too
    both = sorted(lora & saved)
    if both:
        raise UnsupportedConfigError(f"peft.modules_to_save: {moe} and peft.target_modules both take {both} (peft "
                                     "cannot train a module in full that a LoRA adapts): drop it from one")


def _moe_savable(chunk: ModelChunk) -> list[tuple[str, str, tuple[str, ...]]]:
    """(the chunk's parameter, its PEFT key, the `modules_to_save` names that take it) of each MoE router and shared
    expert gate (peft matches names by suffix, so on Qwen2-MoE `gate` takes `shared_expert_gate` too)."""
    out = []
    for i, layer in _moe_layers(chunk):
        m, L = f"{PEFT_PREFIX}{layer_prefix(i)}mlp.", f"layers.{i}.mlp."
        out.append((L + "router.weight", m + "gate.weight", ("gate",)))
        if hasattr(layer, "shared_gate"):
            out.append((L + "shared_gate.weight", m + SHARED_GATE + ".weight", MOE_SAVABLE))
    return out


def check_unwrapped(hf: PretrainedConfig, cfg: PeftConfig) -> None:
    """LoRA on a multimodal wrapper's language model is not built: peft names the adapted modules by their paths
    in the wrapper's class (`model.language_model.layers.…`), which hfmeg's adapter files do not write."""
    if text_config(hf) is not hf:
        raise UnsupportedConfigError(f"peft.method: {cfg.method} on a multimodal checkpoint (config.json model_type "
                                     f"{hf.model_type!r}) is not supported; fine-tune it in full")


def attach(chunk: ModelChunk, cfg: PeftConfig) -> None:
    """Freeze `chunk`'s base and give every targeted base layer its (uninitialised) adapter.

    Call it after the base weights are loaded and before the data-parallel wrapper and the
    optimizer are built, so they see only the adapters as trainable."""
    check_model(chunk.cfg, cfg)
    for p in chunk.parameters():
        p.requires_grad_(False)
    params = dict(chunk.named_parameters())
    for module in cfg.modules_to_save:
        if SAVABLE.get(module) in params:
            params[SAVABLE[module]].requires_grad_(True)
    for local, _, names in _moe_savable(chunk):  # the router's role is already partial over TP (`models/moe.py`)
        if set(names) & set(cfg.modules_to_save):
            params[local].requires_grad_(True)
    moe = chunk.cfg.moe
    peft_names = spec_of(chunk.cfg).peft
    targeted = set(cfg.module_targets(peft_names))
    weight = next(chunk.parameters())
    place = dict(device=weight.device, dtype=weight.dtype)
    for base in _bases(chunk):
        if not targeted & {p.name for p in base.projections}:
            continue
        layer = chunk.get_submodule(base.local)
        adapter = LoraAdapter(base.projections, targeted, layer.matmul_shape()[1], base.column, base.groups, cfg,
                              chunk.ps, base.replicated, base.whole_partial)
        layer.adapter = adapter.to(**place)
    if moe is None or not peft_names.experts:
        return
    wanted = cfg.moe_targets()[1]
    h, f = chunk.cfg.hidden_size, moe.expert_ffn_size
    for i, layer in _moe_layers(chunk):
        if "gate.weight" in wanted:
            router = [Projection("gate", f"{layer_prefix(i)}mlp.gate", moe.num_experts)]
            layer.router.adapter = LoraAdapter(router, {"gate"}, h, True, 1, cfg, chunk.ps, replicated=True).to(**place)
        for param, (name, n_in, n_out) in (("gate_up_proj", ("fc1", h, 2 * f)), ("down_proj", ("fc2", f, h))):
            if param in wanted:
                lora = ExpertLora(chunk.experts, cfg.param_rank(param)[0], n_in, n_out, cfg.param_scale(param))
                setattr(layer.experts, f"{name}_lora", lora.to(**place))


@contextmanager
def adapters_off(chunks: list[ModelChunk]):
    """Inside the block every adapter of `chunks` is detached from its base layer, so the chunks compute the frozen
    base alone (a LoRA preference run's reference model); each is put back on exit."""
    held = [(parent, name, child) for chunk in chunks for parent in chunk.modules()
            for name, child in parent.named_children() if isinstance(child, (LoraAdapter, ExpertLora))]
    for parent, name, _ in held:
        setattr(parent, name, None)
    try:
        yield
    finally:
        for parent, name, child in held:
            setattr(parent, name, child)


def adapter_tensors(chunk: ModelChunk) -> list[AdapterTensor]:
    """Every adapter tensor of `chunk` (and every `modules_to_save` one): its stored name (`stored_tensors`),
    PEFT key and split kind."""
    params = dict(chunk.named_parameters())
    vocab = Vocab(chunk.cfg.vocab_size, chunk.vocab_multiple)
    out = [AdapterTensor(local, f"{PEFT_PREFIX}{'model.' if hf == 'embed_tokens' else ''}{hf}.weight", vocab)
           for hf, local in SAVABLE.items() if local in params and params[local].requires_grad]
    out += [AdapterTensor(local, hf, REPLICATED) for local, hf, _ in _moe_savable(chunk) if params[local].requires_grad]
    for base in _bases(chunk):
        adapter = chunk.get_submodule(base.local).adapter
        for p in base.projections:
            if adapter is None or not hasattr(adapter, p.name):
                continue
            local = f"{base.local}.adapter.{p.name}."
            hf = f"{PEFT_PREFIX}{p.module}."
            # derived from the base's split: a column-parallel base's B (and magnitudes) is cut like its rows
            rows = p.rows if base.column and not base.replicated else REPLICATED
            out += [AdapterTensor(local + "lora_A", hf + "lora_A.weight", REPLICATED if base.column else COLS),
                    AdapterTensor(local + "lora_B", hf + "lora_B.weight", rows)]
            if getattr(adapter, p.name).dora:
                out.append(AdapterTensor(local + "lora_magnitude_vector", hf + "lora_magnitude_vector", rows))
    for i, layer in _moe_layers(chunk):
        loras = {"gate_up_proj": getattr(layer.experts, "fc1_lora", None),
                 "down_proj": getattr(layer.experts, "fc2_lora", None)}
        keys = _expert_keys(i, tuple(p for p in ("gate.weight", "gate_up_proj", "down_proj")
                                     if loras.get(p) is not None or (p == "gate.weight" and layer.router.adapter)))
        if "gate.weight" in keys:
            local = f"layers.{i}.mlp.router.adapter.gate."
            out += [AdapterTensor(local + f, keys["gate.weight"] + f + ".weight", REPLICATED)
                    for f in ("lora_A", "lora_B")]
        for param, name in (("gate_up_proj", "fc1_lora"), ("down_proj", "fc2_lora")):
            if param in keys:
                out += [AdapterTensor(f"layers.{i}.mlp.experts.{name}.{e}.{f}", f"{keys[param]}{f}.weight",
                                      EXPERT_ROWS if f == "lora_A" else EXPERT_COLS, (e, chunk.cfg.moe.num_experts))
                        for f in ("lora_A", "lora_B") for e in chunk.experts]
    return out


def fresh_a(name: str, r: int, in_features: int, seed: int) -> torch.Tensor:
    """A new full `A` `[r, in]`: peft's Kaiming-uniform (a = sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in)),
    drawn from a generator of the run seed and the tensor's name (the same on every layout)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(in_features)
    return torch.empty(r, in_features).uniform_(-bound, bound, generator=g)


@torch.no_grad()
def initialise(chunk: ModelChunk, cfg: PeftConfig, seed: int, hf_tensors=None) -> None:
    """Fill the adapters of `chunk`: from `hf_tensors` (PEFT key -> full tensor, e.g. an adapter folder
    `init_from` names) or fresh (`fresh_a`, B = 0, DoRA's magnitude the row norms of `W + scale B A`)."""
    params = stored_tensors(chunk)
    for t in adapter_tensors(chunk):
        p = params[t.local]
        if hf_tensors is not None:
            if t.hf not in hf_tensors:
                raise CheckpointError(f"adapter has no tensor {t.hf}; adapters on only some layers are not "
                                      "supported (peft.init_from)")
            p.copy_(t.shard(hf_tensors[t.hf], chunk.ps))
        elif "lora_" not in t.hf:
            continue  # a module trained in full (`modules_to_save`) starts from the base's weights
        elif t.local.endswith("lora_A"):  # peft draws the whole A (of an expert stack: the whole [E r, in])
            p.copy_(t.shard(fresh_a(t.hf, *t.full_shape(p.shape, chunk.ps.tp), seed), chunk.ps))
        else:
            p.zero_()
    if hf_tensors is None and cfg.method == "dora":
        for base in _bases(chunk):
            layer = chunk.get_submodule(base.local)
            if layer.adapter is not None:
                layer.adapter.reset_magnitudes(layer.matmul_weight())
