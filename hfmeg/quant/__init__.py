"""Number formats below bf16: how quantized weights are stored, and their arithmetic back to floats.

- `formats.py`: a checkpoint's `quantization_config`, read into a typed `QuantFormat` (MXFP4 or block-scaled
  FP8) or refused by its field.
- `mxfp4.py`: OCP MXFP4 (gpt-oss's experts): e2m1 values two to a byte, one e8m0 scale per 32 values.
- `fp8_blocks.py`: block-scaled FP8 (DeepSeek-V3, Qwen3-FP8): e4m3 weights and one fp32 `weight_scale_inv` per
  block of rows x columns.

Pure tensor arithmetic on torch, below `parallel/` and `models/` so that FP8 compute (issue 48) can use the same
formats; `checkpoint/quantized.py` uses them to dequantize a released checkpoint while streaming it.
"""
