"""The elementwise pieces of a decoder layer, eager or fused by `torch.compile`.

RMSNorm, RoPE and SwiGLU are memory-bound chains of elementwise ops; compiled, each
becomes one fused kernel (Inductor emits Triton on GPUs) instead of 5-10 separate
passes over the activations. `Kernels(None)` runs them eagerly (the default on CPU);
`Kernels("inductor")` compiles each function once per process, with the same maths. With
`model.compile` a dense decoder layer is compiled whole (models/decoder.py), these inside it;
MoE layers and the final norm use these compiled kernels of their own.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 and scale in the input dtype, as the HF reference does.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: scaled by (1 + w), in fp32, then rounded once (transformers' Gemma2RMSNorm)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


def rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma 4's RMSNorm: scaled by w (none: no weight, its value norm) in fp32, then rounded once."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 if weight is None else x32 * weight.float()).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[b, heads, s, d]` by cos/sin `[b, s, r]` (HF rotate-half convention); with r < d (partial
    rotary) the first r dims are rotated and the others pass unchanged, as transformers' Phi-3 does."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    if r < x.shape[-1]:
        rot, rest = x.split([r, x.shape[-1] - r], dim=-1)
        return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)
    return x * cos + _rotate_half(x) * sin


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts' GLU: the gate clamped above and the up projection both sides at `limit`, a sigmoid of
    gain `alpha`, and up + 1 (in transformers' order of operations)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gemma's gated MLP: `gelu_pytorch_tanh` on the gate."""
    return F.gelu(gate, approximate="tanh") * up


@cache
def _compiled(fn, backend: str):
    return torch.compile(fn, backend=backend, dynamic=False)


class Kernels:
    """The functions, compiled with `backend` or eager when it is None."""

    def __init__(self, backend: str | None = None):
        self.backend = backend
        pick = (lambda f: f) if backend is None else (lambda f: _compiled(f, backend))
        self.rms_norm, self.rope, self.swiglu = pick(rms_norm), pick(rope), pick(swiglu)
        self.rms_norm_offset, self.geglu = pick(rms_norm_offset), pick(geglu)
        self.rms_norm_fp32, self.clamped_swiglu = pick(rms_norm_fp32), pick(clamped_swiglu)
