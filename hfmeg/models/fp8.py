"""`model.fp8`: which linears of a model run their GEMMs in FP8, by rule, and the start-up lines that say so.

Candidates are the layers whose GEMMs are plain linears: column- and row-parallel linears, replicated linears
(MLA's latent projections, a shared expert) and the grouped routed experts. The LM head, the embeddings and
the MoE router stay in high precision: the head's logits and the router's scores feed a softmax over many
outcomes where an FP8 error moves probability mass, and an embedding is a lookup, not a GEMM. The router is
excluded by the pattern `*.router` (always applied); `model.fp8_exclude` adds patterns (`fnmatch` on the module
name, e.g. `layers.0.*`, `*.fc2`). A layer with a GEMM dim, as this rank holds it, not a multiple of 16 is
skipped: `torch._scaled_mm` refuses it, and emulation follows the hardware.

Each converted layer gets an `Fp8Gemms` naming the dims of its operands that are split over TP
(`quant/fp8_training.py` says why scales need them):
- column-parallel: W's rows (output features) and the output gradient's features;
- row-parallel: W's columns (input features) and the input's features;
- a replicated linear whose role says it sees only this rank's tokens (`ParamRole.sequence_parallel`), and the
  grouped experts (this rank's block of the tokens, `split_tokens`): the input's and gradient's token rows.
"""

from __future__ import annotations

from dataclasses import replace
from fnmatch import fnmatch

from torch import nn

from ..parallel.layers import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from ..parallel.roles import role_of
from ..parallel.state import ParallelState
from ..quant.fp8_training import FP8_MULTIPLE, Fp8Gemms, float8_config, hardware_fp8
from .moe import GroupedExperts

ALWAYS_EXCLUDED = ("*.router",)


def _gemms(module: nn.Module, config, ps: ParallelState) -> tuple[Fp8Gemms, list[tuple[int, int]]] | None:
    """The layer's `Fp8Gemms` and its local GEMM shapes `(out, in)`, or None for a layer without plain GEMMs."""
    group = ps.tp_group if ps.tp > 1 else None
    if isinstance(module, ColumnParallelLinear):
        return Fp8Gemms(config, group, weight_split=0, grad_split=1), [tuple(module.weight.shape)]
    if isinstance(module, RowParallelLinear):
        return Fp8Gemms(config, group, input_split=1, weight_split=1), [tuple(module.weight.shape)]
    if isinstance(module, ReplicatedLinear):
        rows = 0 if role_of(module, "weight").sequence_parallel else None
        return Fp8Gemms(config, group, input_split=rows, grad_split=rows), [tuple(module.weight.shape)]
    if isinstance(module, GroupedExperts):
        shapes = [tuple(module.fc1.shape[1:]), tuple(module.fc2.shape[1:])]
        # An expert's grad weight reduces over its routed rows, a count FP8 GEMMs need padded to a multiple of 16
        # (torchao pads the inner dim on request; its emulation needs no padding).
        padded = replace(config, pad_inner_dim=True)
        return Fp8Gemms(padded, group, input_split=0, grad_split=0), shapes
    return None


def convert_fp8(chunks: list[nn.Module], recipe: str, exclude: list[str], ps: ParallelState) -> list[str]:
    """Set `fp8` on every linear of `chunks` the rules convert (module doc); the start-up lines that list what was
    converted, what was not and why, and whether the GEMMs run on FP8 hardware or emulated."""
    emulate = not hardware_fp8(ps.device)
    config = float8_config(recipe, emulate)
    patterns = list(ALWAYS_EXCLUDED) + list(exclude)
    converted, excluded, misfit = [], [], []
    for chunk in chunks:
        for name, module in chunk.named_modules():
            found = _gemms(module, config, ps)
            if found is None:
                continue
            gemms, shapes = found
            if any(fnmatch(name, p) for p in patterns):
                excluded.append(name)
            elif any(d % FP8_MULTIPLE for shape in shapes for d in shape):
                misfit.append(f"{name} {'x'.join(map(str, shapes[0]))}")
            else:
                module.fp8 = gemms
                converted.append(name)
    where = ("torch._scaled_mm" if not emulate else
             f"emulated on {ps.device.type} (no FP8 GEMM here: torchao's emulation, fp32 products of the FP8 values)")
    lines = [f"fp8 {recipe}: {len(converted)} linears of rank {ps.rank} in FP8, {where}",
             f"fp8 converted: {_names(converted)}",
             f"fp8 not converted: LM head and embeddings (always); excluded by {', '.join(patterns)}: "
             f"{_names(excluded)}; a dim not a multiple of {FP8_MULTIPLE}: {_names(misfit)}"]
    return lines


def _names(names: list[str], shown: int = 6) -> str:
    """The first `shown` names and how many more (a start-up line stays a line)."""
    if not names:
        return "none"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
