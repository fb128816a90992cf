"""A quantized release read as the float model it encodes: each quantized tensor dequantized as it is read.

The stored pairs, by format (`quant/formats.py`), and the name each one is read under:
- MXFP4 (gpt-oss's experts): `…experts.gate_up_proj_blocks` + `…_scales` are `…experts.gate_up_proj`, as
  transformers holds it. The checkpoint stores each expert's matrix as [out, in] rows of 32-value blocks
  (`quant/mxfp4.py`), transformers' stacked parameter is [E, in, out]: the dequantized [E, out, in] is transposed.
- block-scaled FP8 (DeepSeek-V3, Qwen3-FP8): an `F8_E4M3` tensor `….weight` (or a stacked `…_proj`) + its
  `….weight_scale_inv` (`…_proj_scale_inv`) are that weight, dequantized in fp32 (`quant/fp8_blocks.py`). Its
  dtype is reported as the checkpoint's declared `torch_dtype`, the dtype the converter writes unless told
  otherwise: the same rounding as transformers' dequantizing load in that dtype.
- bitsandbytes 4-bit (the `*-bnb-4bit` repos, transformers' `save_pretrained` of a `load_in_4bit` model): a linear's
  `….weight` holds its 4-bit codes (uint8 [rows * cols / 2, 1]), beside `….weight.absmax`, `.quant_map`, with double
  quantization `.nested_absmax` and `.nested_quant_map`, and `….weight.quant_state.bitsandbytes__nf4` (or `__fp4`):
  the rest of bitsandbytes' `QuantState` (shape, dtype, block sizes, offset) as JSON bytes. The state is rebuilt by
  bitsandbytes' own `QuantState.from_dict`. A QLoRA run reads the codes as they are (`packed`: no dequantize /
  requantize round, so each rank's weight is bit for bit the slice of bitsandbytes' dequantization of the stored
  one); any other reader gets the weight dequantized by bitsandbytes' `dequantize_4bit` in the state's dtype, the
  values transformers computes when it loads the 4-bit model (a full-precision run or conversion of such a
  checkpoint trains or writes the 4-bit grid's values: dequantized rather than refused, like the other formats).

Every other tensor is read as stored, so a checkpoint whose weights were dequantized already but whose config kept
the `quantization_config` reads as what it holds. Only one tensor (one stacked expert projection at most) is
dequantized at a time: peak memory stays about one layer. A data tensor without its scale, a scale without its
data, or a scale whose shape the format does not imply is refused in one line naming the tensor (for bitsandbytes:
codes or absmax of another size than the state's shape and block size imply, a missing state tensor, a state of
another quant type or double quantization than `quantization_config` says).
"""

from __future__ import annotations

import json
import math

import torch

from ..errors import CheckpointError
from ..quant.formats import QuantFormat
from ..quant.fp8_blocks import dequantize_fp8_blocks, scale_shape
from ..quant.mxfp4 import BLOCK, BLOCK_BYTES, dequantize_mxfp4
from ..quant.nf4 import Packed4bit, from_quant_state, require_bitsandbytes

MXFP4_SUFFIXES = ("_blocks", "_scales")
FP8 = torch.float8_e4m3fn
BNB_STATE = ".quant_state.bitsandbytes__"  # + nf4 / fp4: the packed JSON of a 4-bit weight's QuantState
BNB_PARTS = ("absmax", "quant_map")  # beside the codes, always; with double quantization also BNB_NESTED
BNB_NESTED = ("nested_absmax", "nested_quant_map")


def fp8_scale_name(name: str) -> str:
    """`x.weight` -> `x.weight_scale_inv`; a stacked `x.gate_up_proj` -> `x.gate_up_proj_scale_inv`."""
    return name + "_scale_inv"


class QuantizedTensors:
    """Logical name -> the stored (data, scale) names, read over a checkpoint's `read`, `shape` and `dtype`."""

    def __init__(self, fmt: QuantFormat, folder, names: list[str], shape, dtype, declared: torch.dtype, read):
        self.fmt, self.folder, self.declared = fmt, folder, declared
        self.pairs: dict[str, tuple[str, ...]] = {}  # logical name -> (stored data, its scales / state tensors)
        self._shape, self._dtype = shape, dtype
        self._bnb_states: dict[str, dict] = {}  # bitsandbytes: logical name -> its QuantState's non-tensor items
        if fmt.method == "mxfp4":
            self._pair_mxfp4(names)
        elif fmt.method == "fp8":
            self._pair_fp8(names)
        else:
            self._pair_bnb(names, read)
        self._float_names = {data: name for name, (data, *_) in self.pairs.items()}
        self._float_names.update({side: None for _, *sides in self.pairs.values() for side in sides})

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

    def _pair_bnb(self, names: list[str], read) -> None:
        require_bitsandbytes(f"{self.folder}: a bitsandbytes 4-bit checkpoint")
        have = set(names)
        for state_name in [n for n in names if BNB_STATE in n]:
            name, quant_type = state_name.split(BNB_STATE)
            try:
                state = json.loads(bytes(read(state_name).tolist()).decode())
                rows, cols = state["shape"]
                blocksize, nested = int(state["blocksize"]), "nested_blocksize" in state
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{self.folder}: tensor {state_name} is not a bitsandbytes quant state "
                                      f"({type(e).__name__}: {e})") from None
            if state.get("quant_type") != quant_type or quant_type != self.fmt.quant_type \
                    or nested != self.fmt.double_quant:
                raise CheckpointError(
                    f"{self.folder}: tensor {state_name} holds a {state.get('quant_type')} state "
                    f"{'with' if nested else 'without'} double quantization; quantization_config says "
                    f"{self.fmt.quant_type} {'with' if self.fmt.double_quant else 'without'}")
            blocks = math.ceil(rows * cols / blocksize)
            parts = BNB_PARTS + (BNB_NESTED if nested else ())
            sizes = {name: math.ceil(rows * cols / 2), "absmax": blocks, "quant_map": 16}
            if nested:
                sizes.update(nested_absmax=math.ceil(blocks / int(state["nested_blocksize"])), nested_quant_map=256)
            for part in (name, *parts):
                stored = part if part == name else f"{name}.{part}"
                if stored not in have:
                    raise CheckpointError(f"{self.folder}: tensor {stored} is missing (the bitsandbytes 4-bit "
                                          f"{'codes' if part == name else part} of {name})")
                numel = math.prod(self._shape(stored))
                if numel != sizes[part]:
                    raise CheckpointError(
                        f"{self.folder}: tensor {stored} has {numel} values, a [{rows}, {cols}] {quant_type} weight in "
                        f"blocks of {blocksize} implies {sizes[part]}")
            self.pairs[name] = (name, *(f"{name}.{p}" for p in parts), state_name)
            self._bnb_states[name] = state

    def _bnb_read(self, name: str, read):
        """The stored codes of the 4-bit weight `name` and bitsandbytes' `QuantState`, rebuilt from its side
        tensors."""
        F = require_bitsandbytes(f"{self.folder}: a bitsandbytes 4-bit checkpoint")
        codes, *side = (read(n) for n in self.pairs[name])
        parts = BNB_PARTS + (BNB_NESTED if "nested_blocksize" in self._bnb_states[name] else ())
        state = dict(zip(parts, side))
        state[BNB_STATE.lstrip(".") + self._bnb_states[name]["quant_type"]] = side[-1]
        return codes, F.QuantState.from_dict(state, torch.device("cpu"))

    def stored_4bit(self, name: str) -> bool:
        """Whether `name` is stored as bitsandbytes 4-bit codes (a QLoRA base reads them as they are: `packed`)."""
        return name in self._bnb_states

    def packed(self, name: str, read) -> Packed4bit:
        """The bitsandbytes 4-bit weight `name` as stored: its codes, its absmax (dequantized where nested)."""
        return from_quant_state(name, *self._bnb_read(name, read))

    def hidden(self) -> set[str]:
        """The stored names the logical ones replace."""
        return set(self._float_names) - set(self.pairs)

    def float_name(self, stored: str) -> str | None:
        """The name a stored tensor is read under: a quantized tensor's data -> the float tensor's, its scale ->
        None (folded into it), any other -> itself."""
        return self._float_names.get(stored, stored)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._bnb_states:
            return tuple(self._bnb_states[name]["shape"])
        data = self._shape(self.pairs[name][0])
        if self.fmt.method == "fp8":
            return tuple(data)
        *lead, out, blocks, _ = data
        return (*lead, blocks * BLOCK, out)

    def dtype(self, name: str) -> torch.dtype:
        if name in self._bnb_states:  # what bitsandbytes dequantizes to: the dtype the weight was quantized from
            return getattr(torch, self._bnb_states[name]["dtype"])
        return self.declared

    def get(self, name: str, read) -> torch.Tensor:
        if name in self._bnb_states:
            return require_bitsandbytes().dequantize_4bit(*self._bnb_read(name, read))
        data, scale = (read(n) for n in self.pairs[name])
        if self.fmt.method == "fp8":
            return dequantize_fp8_blocks(data, scale, self.fmt.block)
        return dequantize_mxfp4(data, scale, self.declared).transpose(-1, -2).contiguous()
