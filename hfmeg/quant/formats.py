"""A checkpoint's `quantization_config`, as the releases publish it.

    gpt-oss:               {"quant_method": "mxfp4", "modules_to_not_convert": [...]}
    DeepSeek-V3, Qwen3-FP8: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                             "weight_block_size": [128, 128]}

Which tensors are quantized is read off the tensors themselves (`checkpoint/quantized.py`: MXFP4's `*_blocks` /
`*_scales` pairs, FP8's `F8_E4M3` weights with their `weight_scale_inv`), so `modules_to_not_convert` is not needed
to read a checkpoint. Anything this does not describe is refused by its field: a method, an FP8 encoding or scale
format hfmeg cannot decode, and static activation scales (their `activation_scale` tensors are a compute recipe
for FP8 inference, not part of the weights).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import require

METHODS = ("mxfp4", "fp8")


@dataclass(frozen=True)
class QuantFormat:
    method: str  # one of METHODS
    block: tuple[int, int] | None = None  # fp8: rows x columns sharing one scale


def quant_format(config: object) -> QuantFormat | None:
    """The format of a `quantization_config` (a dict, or transformers' config object); None when there is none."""
    if config is None:
        return None
    if not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    method = config.get("quant_method")
    require(method in METHODS, "quantization_config.quant_method",
            f"{method!r} is not supported (supported: {', '.join(METHODS)}; others: load the model dequantized "
            "with transformers and save it)")
    if method == "mxfp4":
        return QuantFormat("mxfp4")
    require(config.get("fmt", "e4m3") == "e4m3", "quantization_config.fmt",
            f"{config.get('fmt')!r} is not supported (supported: 'e4m3')")
    require(config.get("activation_scheme", "dynamic") == "dynamic", "quantization_config.activation_scheme",
            f"{config.get('activation_scheme')!r} is not supported (supported: 'dynamic')")
    require(config.get("scale_fmt") in (None, "float"), "quantization_config.scale_fmt",
            f"{config.get('scale_fmt')!r} is not supported (supported: fp32 scales)")
    block = config.get("weight_block_size")
    require(isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block),
            "quantization_config.weight_block_size", f"{block!r}: expected [rows, columns], two positive integers")
    return QuantFormat("fp8", (block[0], block[1]))
