"""Typed parameter roles: what every consumer needs to know about a parameter, declared once.

A parameter's role says how it is laid out across ranks and how its gradient must be
finished, so gradient sums, norm counting, bucket layout and weight-decay exclusion
read one record instead of matching names or ad-hoc attributes:

- `tp_dim`: the dim split over tensor-parallel ranks (0 for column-parallel weights and
  biases, vocab-parallel embeddings and heads; 1 for row-parallel weights), or None
  when every TP rank holds the whole tensor. A TP-replicated gradient counts once in
  the global norm (on TP rank 0).
- `sequence_parallel`: a TP-replicated parameter whose gradient is partial on each TP
  rank, summed over TP once per step: norms and row-parallel biases under SP (each rank
  sees a sequence shard), and, with or without SP, Qwen3's per-head q/k norms (each rank
  sees its own heads) and the MoE router and experts (each rank routes its own token
  shard, `models/moe.py`).
- `tied`: the name of a group of copies of one model tensor held on several pipeline
  stages ("embedding": the first stage's token embedding and the last stage's LM head
  when embeddings are tied). With PP > 1 their gradients are summed over the group's
  process group, so the copies take identical steps. `tied_copy` marks the copies other
  than the owner's: they are not counted again in the global norm.
- `kind`: what the tensor is, for weight-decay exclusion (`weight`, `bias`, `norm`,
  `norm_bias`, `embedding`).
- `expert`: a routed expert weight (`models/moe.py`: a rank's experts stacked in one parameter). Under expert parallelism each
  EP rank holds only some experts, and their gradients are summed, sharded and gathered
  over the expert-data-parallel group (`data_parallel.py`); consumers find them by this
  flag, never by name. The router and Qwen2-MoE's
  shared expert are not experts in this sense: every rank holds them.
- `shared_rows`, `shared_by`: a TP-sharded tensor (`tp_dim` 0) whose last `shared_rows` rows (dim 0) are a copy
  held by `shared_by` consecutive TP ranks: the fused QKV's K and V rows when TP exceeds the KV heads
  (`models/attention.py`). Each holder's gradient of those rows comes from its own query heads only, so
  they are summed over the holders (`ParallelState.tp_block_group`) once per step, and they count in the
  global norm on the block's first rank only (`optim/distributed_optimizer.py`).
- `adapter`: a low-rank adapter weight (`hfmeg/peft`): trained while the base is frozen,
  saved and exported apart from the base. Its layout is said by the other fields: a
  LoRA factor held whole on every TP rank sees only this rank's share of the base's
  output (column-parallel A) or input (row-parallel B), so it is `sequence_parallel`.

Nothing here assumes the list of fields is closed.

Roles are declared where layers create their parameters (`parallel/layers.py`,
`models/norm.py`, `models/decoder.py`) and recorded on the owning module, by the
parameter's attribute name, not on the tensor: materialising a meta-built chunk
(`to_empty`) or loading with `assign=True` replaces parameter objects, and a role
must outlive that. Consumers walk a model with `named_roles`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

Kind = Literal["weight", "bias", "norm", "norm_bias", "embedding"]
_ATTR = "_hfmeg_role"


@dataclass(frozen=True)
class ParamRole:
    kind: Kind
    tp_dim: int | None = None
    sequence_parallel: bool = False
    tied: str | None = None
    tied_copy: bool = False
    expert: bool = False
    adapter: bool = False
    shared_rows: int = 0
    shared_by: int = 1

    def __post_init__(self) -> None:
        if self.shared_by > 1 and self.tp_dim != 0:
            raise ValueError("rows shared by TP ranks belong to a tensor split on dim 0")
        if self.sequence_parallel and self.tp_dim is not None:
            raise ValueError("a sequence-parallel parameter is TP-replicated (tp_dim must be None)")
        if self.tied_copy and self.tied is None:
            raise ValueError("tied_copy needs a tied group")

    @property
    def tp_replicated(self) -> bool:
        return self.tp_dim is None

    def counted_on(self, tp_rank: int) -> bool:
        """Whether this rank's copy counts in the global gradient norm (each model element once; the
        optimizer leaves out the `shared_rows` of every holder but the first, `Bucket.shared_runs`)."""
        return not self.tied_copy and (self.tp_dim is not None or tp_rank == 0)

    def shared_span(self, shape: torch.Size) -> tuple[int, int] | None:
        """The flat element range [lo, hi) of the rows shared with other TP ranks, None if there are none."""
        if self.shared_by == 1:
            return None
        numel = shape.numel()
        return numel - self.shared_rows * (numel // shape[0]), numel


def set_role(module: nn.Module, name: str, role: ParamRole) -> None:
    """Declare the role of `module`'s own parameter `name` (once, where the layer creates it)."""
    module.__dict__.setdefault(_ATTR, {})[name] = role


def add_param(module: nn.Module, name: str, *shape: int, role: ParamRole) -> None:
    """Register an uninitialised parameter with its role (layers never initialise values: checkpoints do)."""
    module.register_parameter(name, nn.Parameter(torch.empty(*shape)))
    set_role(module, name, role)


def role_of(module: nn.Module, name: str) -> ParamRole:
    """The role of `module`'s own parameter `name`."""
    role = module.__dict__.get(_ATTR, {}).get(name)
    if role is None:
        raise TypeError(f"parameter {name!r} of {type(module).__name__} has no role: the layer that creates "
                        "it must declare one with hfmeg.parallel.roles.set_role")
    return role


def named_roles(model: nn.Module) -> list[tuple[str, nn.Parameter, ParamRole]]:
    """(qualified name, parameter, role) of every parameter of `model`, in `named_parameters` order."""
    out, seen = [], set()
    for prefix, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                out.append((f"{prefix}.{name}" if prefix else name, p, role_of(module, name)))
    return out
