"""Stored names: the names a model's tensors have in checkpoints and optimizer state, declared by the layer.

A parameter is stored under its own qualified name, except a stacked one: the grouped
MoE experts' `[E_local, ...]` weights (`models/moe.py`) are stored as one tensor per
slice along dim 0, under names the layer declares where it creates the parameter
(`set_stored_names`). Each expert keeps the name it had when it was a module of its own,
with its global index (`layers.3.mlp.experts.5.fc1.weight`), so

- a shard folder or optimizer shard written at any EP size holds every expert once under
  one name, and EP resharding (`tools/reshard_mp.py`) moves experts one by one;
- the key table (`checkpoint/rules.py`) keeps one rule per expert, so HF checkpoints
  stream expert by expert and round trips stay bit-exact;
- checkpoints written before the experts were stacked load unchanged.

Like roles (`parallel/roles.py`), the names are recorded on the owning module by
attribute name, not on the tensor, so they outlive `to_empty` and `assign=True` loads.
Readers build views on demand (`stored_tensors`): the data-parallel wrapper moves
parameters into its buffers, so a view taken earlier would be stale.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

_ATTR = "_hfmeg_stored_names"


def set_stored_names(module: nn.Module, name: str, slices: list[str]) -> None:
    """Store `module`'s parameter `name` as its dim-0 slices, slice j under `slices[j]` (relative to `module`)."""
    module.__dict__.setdefault(_ATTR, {})[name] = list(slices)


def _entries(model: nn.Module, remove_duplicate: bool):
    """(qualified parameter name, parameter, qualified slice names or None) in `named_parameters` order."""
    seen = set()
    for prefix, module in model.named_modules(remove_duplicate=remove_duplicate):
        stacked = module.__dict__.get(_ATTR, {})
        for name, p in module.named_parameters(recurse=False):
            if remove_duplicate and id(p) in seen:
                continue
            seen.add(id(p))
            dot = f"{prefix}." if prefix else ""
            slices = [dot + s for s in stacked[name]] if name in stacked else None
            yield dot + name, p, slices


def stored_tensors(model: nn.Module, of: Callable[[nn.Parameter], torch.Tensor] = lambda p: p,
                   remove_duplicate: bool = True) -> dict[str, torch.Tensor]:
    """{stored name: tensor} of `model`: `of(parameter)` (e.g. its `main_grad`), or its dim-0 slice for a
    stacked parameter. `remove_duplicate=False`: a Parameter shared by several modules under each name."""
    out = {}
    for name, p, slices in _entries(model, remove_duplicate):
        t = of(p)  # None for a frozen parameter's gradient: each slice's is None too
        out.update({name: t} if slices is None else {s: None if t is None else t[j] for j, s in enumerate(slices)})
    return out


def stored_slices(model: nn.Module) -> dict[str, list[str]]:
    """{qualified parameter name: its slices' stored names} of every stacked parameter of `model`."""
    return {name: slices for name, _, slices in _entries(model, True) if slices is not None}
