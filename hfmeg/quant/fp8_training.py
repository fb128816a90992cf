"""FP8 training compute (`model.fp8`): torchao's float8 recipes, run on a linear whose operands are split over TP.

A recipe says, for each of a linear's three GEMMs

    output        y  = x W^T       x `[T, in]`, W `[out, in]`
    grad input    dx = g W         g `[T, out]`
    grad weight   dW = g^T x

how each operand is cast to FP8 before it: its dtype (e4m3, or e5m2 for gradients) and the extent one scale
covers (`scale = fp8_max / amax` over that extent). The recipes are torchao's own (`Float8LinearConfig.
from_recipe_name`), taken as they are:

- `tensorwise`: one scale per operand per GEMM (gradients in e5m2);
- `rowwise`: one scale per row along the GEMM's reduced dim, powers of two, all e4m3;
- `rowwise_with_gw_hp`: rowwise for the output, the weight tensorwise for the grad input, and the grad weight
  GEMM in the operands' own precision (it never sees FP8).

The casts and the scaled GEMM are torchao's (`amax_to_scale`, `hp_tensor_and_scale_to_float8`, and
`Float8TrainingTensor`'s `mm`: `torch._scaled_mm` on GPUs with FP8 GEMMs, its emulation, `(a/sa) @ (b/sb)` in
fp32, elsewhere). What hfmeg adds is where each amax is taken. torchao's module swap sees a whole `nn.Linear`;
here a TP rank holds a slice, and a scale computed from a slice would differ between ranks and from one
process. So each operand names the dim of its 2-D form that is split over the TP group (`Fp8Gemms`), and an
amax whose extent crosses that dim is max-reduced over the group before it becomes a scale:

- tensorwise: every split operand (a column-parallel weight and its output gradient, a row-parallel weight and
  its input, the token-split rows a replicated linear sees);
- rowwise: only where the reduced dim is the split one (the row-parallel input and weight in the output GEMM,
  the column-parallel output gradient and weight in the grad-input GEMM, the token-split operands of a
  replicated linear's grad weight); a row along an unsplit dim lies whole on one rank.

A sequence-parallel activation is all-gathered before the column-parallel GEMM and the gradient of a row-parallel
output before its grad input (`parallel/comm.py`): both are cast whole, in high precision, so their amax needs
no reduction (torchao's own TP casts before the gather to send FP8; hfmeg sends the high-precision tensor).
With these reductions a TP layout computes the same FP8 values as one process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import cache

import torch
import torch.distributed as dist

# torchao's import warns once per CUDA extension it cannot load (every one, on a CPU build of torch): none of them is
# used here, so those lines are silenced for the import, and only for it.
_ao_log = logging.getLogger("torchao")
_level = _ao_log.level
_ao_log.setLevel(logging.ERROR)
import torchao  # noqa: E402,F401

_ao_log.setLevel(_level)
from torchao.float8.config import CastConfig, Float8LinearConfig, ScalingGranularity, ScalingType
from torchao.float8.float8_training_tensor import (
    GemmInputRole,
    LinearMMConfig,
    ScaledMMConfig,
    hp_tensor_and_scale_to_float8,
)
from torchao.float8.float8_utils import amax_to_scale

FP8_MULTIPLE = 16  # what `torch._scaled_mm` needs of every GEMM dim


def hardware_fp8(device: torch.device) -> bool:
    """Whether `device` runs FP8 GEMMs (`torch._scaled_mm`: CUDA compute capability 8.9, Ada/Hopper, and later);
    elsewhere the recipe runs emulated."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@cache
def float8_config(recipe: str, emulate: bool) -> Float8LinearConfig:
    """torchao's config of `recipe` (a `Float8LinearRecipeName`), emulated (`emulate`) where the hardware has no FP8
    GEMM."""
    return replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)


@cache
def _mm_config(config: Float8LinearConfig) -> LinearMMConfig:
    """The three GEMMs' kernel settings, as torchao's `Float8Linear` derives them from its config."""
    return LinearMMConfig(*(ScaledMMConfig(config.emulate, gemm.use_fast_accum, False, config.pad_inner_dim)
                            for gemm in (config.gemm_config_output, config.gemm_config_grad_input,
                                         config.gemm_config_grad_weight)))


@dataclass(frozen=True)
class Fp8Gemms:
    """How one linear runs its GEMMs in FP8: the recipe's config, and which dim of each operand's 2-D form
    (x `[T, in]`, W `[out, in]`, g `[T, out]`) is split over `group` (None: whole on this rank)."""

    config: Float8LinearConfig
    group: dist.ProcessGroup | None = None
    input_split: int | None = None
    weight_split: int | None = None
    grad_split: int | None = None

    def _cast(self, t: torch.Tensor, cast: CastConfig, role: GemmInputRole, dim: int, split: int | None):
        """`t` 2-D as torchao's `Float8TrainingTensor` for a GEMM reducing over `dim` (0 or -1, as torchao names
        them: the cast's row extent under rowwise scaling), or `t` itself where the recipe keeps this operand in
        high precision."""
        if cast.scaling_type is ScalingType.DISABLED:
            return t
        rowwise = cast.scaling_granularity is ScalingGranularity.AXISWISE
        with torch.no_grad():
            if t.numel() == 0:  # an expert without rows: nothing to scale, but the group's collective still runs
                amax = t.new_zeros([1 if d == dim % 2 else n for d, n in enumerate(t.shape)] if rowwise else [])
            else:
                amax = t.abs().amax(dim=dim, keepdim=True) if rowwise else t.abs().max()
            if split is not None and self.group is not None and (not rowwise or split == dim % 2):
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
            scale = amax_to_scale(amax, cast.target_dtype, self.config.round_scales_to_power_of_2)
        return hp_tensor_and_scale_to_float8(t, scale, cast.target_dtype, _mm_config(self.config), role,
                                             dim if rowwise else None)

    def output(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """`x W^T` for `x` `[T, in]`, in `x`'s dtype."""
        c = self.config
        xq = self._cast(x, c.cast_config_input, GemmInputRole.INPUT, -1, self.input_split)
        wq = self._cast(w.t(), c.cast_config_weight, GemmInputRole.WEIGHT, 0, _flip(self.weight_split))
        return torch.mm(xq, wq)

    def grad_input(self, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """`g W` for `g` `[T, out]`."""
        c = self.config
        gq = self._cast(g, c.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, -1, self.grad_split)
        wq = self._cast(w.t(), c.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT, -1, _flip(self.weight_split))
        return torch.mm(gq, wq.t())

    def grad_weight(self, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`g^T x` `[out, in]`, in `x`'s dtype (the recipe's, or the operands' own precision)."""
        c = self.config
        gq = self._cast(g, c.cast_config_grad_output_for_grad_weight, GemmInputRole.GRAD_OUTPUT, 0, self.grad_split)
        xq = self._cast(x, c.cast_config_input_for_grad_weight, GemmInputRole.INPUT, 0, self.input_split)
        return torch.mm(gq.t(), xq)


def _flip(dim: int | None) -> int | None:
    """The split dim of W^T given W's."""
    return None if dim is None else 1 - dim
