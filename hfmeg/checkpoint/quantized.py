"""A quantized release read as the float model it encodes: each quantized tensor dequantized as it is read.

The stored pairs, by format (`quant/formats.py`), and the name each one is read under:
- MXFP4 (gpt-oss's experts): `…experts.gate_up_proj_blocks` + `…_scales` are `…experts.gate_up_proj`, as
  transformers holds it. The checkpoint stores each expert's matrix as [out, in] rows of 32-value blocks
  (`quant/mxfp4.py`), transformers' stacked parameter is [E, in, out]: the dequantized [E, out, in] is transposed.
- block-scaled FP8 (DeepSeek-V3, Qwen3-FP8): an `F8_E4M3` tensor `….weight` (or a stacked `…_proj`) + its
  `….weight_scale_inv` (`…_proj_scale_inv`) are that weight, dequantized in fp32 (`quant/fp8_blocks.py`). Its
  dtype is reported as the checkpoint's declared `torch_dtype`, the dtype the converter writes unless told
  otherwise: the same rounding as transformers' dequantizing load in that dtype.

Every other tensor is read as stored, so a checkpoint whose weights were dequantized already but whose config kept
the `quantization_config` reads as what it holds. Only one tensor (one stacked expert projection at most) is
dequantized at a time: peak memory stays about one layer. A data tensor without its scale, a scale without its
data, or a scale whose shape the format does not imply is refused in one line naming the tensor.
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError
from ..quant.formats import QuantFormat
from ..quant.fp8_blocks import dequantize_fp8_blocks, scale_shape
from ..quant.mxfp4 import BLOCK, BLOCK_BYTES, dequantize_mxfp4

MXFP4_SUFFIXES = ("_blocks", "_scales")
FP8 = torch.float8_e4m3fn


def fp8_scale_name(name: str) -> str:
    """`x.weight` -> `x.weight_scale_inv`; a stacked `x.gate_up_proj` -> `x.gate_up_proj_scale_inv`."""
    return name + "_scale_inv"


class QuantizedTensors:
    """Logical name -> the stored (data, scale) names, read over a checkpoint's `read`, `shape` and `dtype`."""

    def __init__(self, fmt: QuantFormat, folder, names: list[str], shape, dtype, declared: torch.dtype):
        self.fmt, self.folder, self.declared = fmt, folder, declared
        self.pairs: dict[str, tuple[str, str]] = {}
        self._shape, self._dtype = shape, dtype
        if fmt.method == "mxfp4":
            self._pair_mxfp4(names)
        else:
            self._pair_fp8(names)
        self._float_names = {data: name for name, (data, _) in self.pairs.items()}
        self._float_names.update({scale: None for _, scale in self.pairs.values()})

    def _pair_mxfp4(self, names: list[str]) -> None:
        have = set(names)
        for name in names:
            for own, other in (MXFP4_SUFFIXES, MXFP4_SUFFIXES[::-1]):
                if name.endswith(own) and name[: -len(own)] + other not in have:
                    raise CheckpointError(f"{self.folder}: tensor {name[: -len(own)] + other} is missing "
                                          f"(the MXFP4 {other[1:]} of {name})")
            if not name.endswith("_blocks"):
                continue
            base, scales = name[: -len("_blocks")], name[: -len("_blocks")] + "_scales"
            blocks_shape, scales_shape = self._shape(name), self._shape(scales)
            if len(blocks_shape) < 3 or blocks_shape[-1] != BLOCK_BYTES or tuple(scales_shape) != blocks_shape[:-1]:
                raise CheckpointError(
                    f"{self.folder}: tensor {name} has shape {list(blocks_shape)} and {scales} {list(scales_shape)}: "
                    f"MXFP4 stores [..., blocks, {BLOCK_BYTES}] bytes ({BLOCK} values a block) and one scale a block")
            self.pairs[base] = (name, scales)

    def _pair_fp8(self, names: list[str]) -> None:
        have = set(names)
        scales = {n for n in names if n.endswith("_scale_inv")}
        for name in names:
            if name in scales or self._dtype(name) != FP8:
                continue
            scale = fp8_scale_name(name)
            if scale not in have:
                raise CheckpointError(f"{self.folder}: tensor {scale} is missing (the FP8 block scales of {name})")
            want = scale_shape(tuple(self._shape(name)), self.fmt.block)
            if tuple(self._shape(scale)) != want:
                raise CheckpointError(
                    f"{self.folder}: tensor {scale} has shape {list(self._shape(scale))}, {name} "
                    f"{list(self._shape(name))} in blocks of weight_block_size {list(self.fmt.block)} implies {list(want)}")
            self.pairs[name] = (name, scale)
        for scale in scales - {s for _, s in self.pairs.values()}:
            raise CheckpointError(f"{self.folder}: tensor {scale} scales no FP8 tensor "
                                  f"({scale[: -len('_scale_inv')]} is missing or not F8_E4M3)")

    def hidden(self) -> set[str]:
        """The stored names the logical ones replace."""
        return set(self._float_names) - set(self.pairs)

    def float_name(self, stored: str) -> str | None:
        """The name a stored tensor is read under: a quantized tensor's data -> the float tensor's, its scale ->
        None (folded into it), any other -> itself."""
        return self._float_names.get(stored, stored)

    def shape(self, name: str) -> tuple[int, ...]:
        data = self._shape(self.pairs[name][0])
        if self.fmt.method == "fp8":
            return tuple(data)
        *lead, out, blocks, _ = data
        return (*lead, blocks * BLOCK, out)

    def dtype(self, name: str) -> torch.dtype:
        return self.declared

    def get(self, name: str, read) -> torch.Tensor:
        data, scale = (read(n) for n in self.pairs[name])
        if self.fmt.method == "fp8":
            return dequantize_fp8_blocks(data, scale, self.fmt.block)
        return dequantize_mxfp4(data, scale, self.declared).transpose(-1, -2).contiguous()
