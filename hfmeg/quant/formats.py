"""A checkpoint's `quantization_config`, as the releases publish it.

    gpt-oss:               {"quant_method": "mxfp4", "modules_to_not_convert": [...]}
    DeepSeek-V3, Qwen3-FP8: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                             "weight_block_size": [128, 128]}
    `*-bnb-4bit` repos:    {"quant_method": "bitsandbytes", "load_in_4bit": true, "bnb_4bit_quant_type": "nf4",
                            "bnb_4bit_use_double_quant": true, "bnb_4bit_quant_storage": "uint8", ...}

Which tensors are quantized is read off the tensors themselves (`checkpoint/quantized.py`: MXFP4's `*_blocks` /
`*_scales` pairs, FP8's `F8_E4M3` weights with their `weight_scale_inv`, bitsandbytes' `quant_state` tensors), so
`modules_to_not_convert` is not needed to read a checkpoint. Anything this does not describe is refused by its
field: a method (GPTQ, AWQ, ...), an FP8 encoding or scale format hfmeg cannot decode, static activation scales
(their `activation_scale` tensors are a compute recipe for FP8 inference, not part of the weights), and
bitsandbytes' 8-bit (LLM.int8) or 4-bit codes packed into another storage dtype than bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import require

METHODS = ("mxfp4", "fp8", "bitsandbytes")


@dataclass(frozen=True)
class QuantFormat:
    method: str  # one of METHODS
    block: tuple[int, int] | None = None  # fp8: rows x columns sharing one scale
    quant_type: str | None = None  # bitsandbytes: `bnb_4bit_quant_type`, nf4 or fp4
    double_quant: bool | None = None  # bitsandbytes: `bnb_4bit_use_double_quant`


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
    if method == "bitsandbytes":
        return _bitsandbytes(config)
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


def _bitsandbytes(config: dict) -> QuantFormat:
    """bitsandbytes 4-bit (`BitsAndBytesConfig(load_in_4bit=True)`) as transformers saves it."""
    require(bool(config.get("load_in_4bit")) and not config.get("load_in_8bit"), "quantization_config.load_in_4bit",
            "bitsandbytes 8-bit (LLM.int8) is not supported (supported: load_in_4bit)")
    quant_type = config.get("bnb_4bit_quant_type", "fp4")  # transformers' default
    require(quant_type in ("nf4", "fp4"), "quantization_config.bnb_4bit_quant_type",
            f"{quant_type!r} is not supported (supported: 'nf4', 'fp4')")
    require(config.get("bnb_4bit_quant_storage", "uint8") == "uint8", "quantization_config.bnb_4bit_quant_storage",
            f"{config.get('bnb_4bit_quant_storage')!r} is not supported (supported: 'uint8')")
    return QuantFormat("bitsandbytes", quant_type=quant_type,
                       double_quant=bool(config.get("bnb_4bit_use_double_quant", False)))
