"""What `model.fp8` (quant/fp8_training.py) adds to a plan: its FP8 copies in memory and its casts in time.

Memory. A converted linear saves its input and weight for backward in the model dtype, as without FP8 (torchao's
`Float8Linear` does the same), so the saved activations do not change. Each GEMM casts its operands afresh, one byte
an element (and a scale per tensor or row, negligible); the copies live while that linear runs. The most at once is
a backward: the output gradient cast twice (one scaling for the grad input, one for the grad weight), the weight
and the input. `fp8_copy_bytes` is that, for the largest linear of a layer as this rank holds it.

Time. A GEMM's operands are read twice by the cast (the amax, then the scaled copy) in the model dtype and written
once in FP8 (`fp8_cast_bytes`, at streaming bandwidth); the GEMM itself runs at the profile's FP8 rate
(`Profile.fp8_matmul_speedup` times the model dtype's). The LM head, the router and the attention core stay as
they are (models/fp8.py).
"""

from __future__ import annotations

from ..config import ModelConfig
from .activations import Shape, moe_tokens


def fp8_cast_bytes(m: int, k: int, n: int, dtype_bytes: int) -> int:
    """Bytes the casts of a GEMM `[m, k] x [k, n]`'s two operands move: each read twice, written once in FP8."""
    return (2 * dtype_bytes + 1) * (m * k + k * n)


def fp8_copy_bytes(cfg: ModelConfig, x: Shape) -> int:
    """The FP8 copies one linear's backward holds at once, for the largest linear of any layer (module doc)."""
    t, tok, h = x.tp, x.micro_batch * x.seq, cfg.hidden_size
    nh, nkv, d = cfg.num_heads // t, cfg.local_kv_heads(t), cfg.head_dim
    ffn = (2 if cfg.gated_mlp else 1) * cfg.ffn_size // t
    linears = [(tok, h, (nh + 2 * nkv) * d), (tok, nh * d, h), (tok, h, ffn), (tok, ffn, h)]  # (rows, in, out)
    if cfg.moe is not None:
        m = cfg.moe
        rows = moe_tokens(x) * m.top_k  # every routed row, as if one expert took them all: an upper bound
        linears += [(rows, h, 2 * m.expert_ffn_size), (rows, m.expert_ffn_size, h)]
    return max(rows * k + k * n + 2 * rows * n for rows, k, n in linears)
