"""Rotary position embeddings: cos/sin tables (the rotation itself is `kernels.rope`).

Frequencies come from `transformers`' own `ROPE_INIT_FUNCTIONS` for the scaled
types (linear, dynamic NTK, llama3, yarn), so every scaling variant matches the
reference by construction. Dynamic NTK depends on the sequence length: its
frequencies are recomputed for `max(seq_len, max_position_embeddings)`, which is
what HF computes on a fresh model. LongRoPE (Phi-3 128k) keeps two sets, its short and long
factors, and takes the long one when the batch's highest position passes
`original_max_position_embeddings`, as transformers' `dynamic_rope_update` does.

A model with RoPE parameters per layer type (Gemma 3: `ModelConfig.rope_key`) has one
`RotaryEmbedding` per type, each reading its entry (`layer_type`) as transformers does, over its layers'
rotated dims (`dim`: Gemma 4's full-attention heads are twice as wide as its sliding ones). Gemma 4's
full layers use `proportional` RoPE: transformers' frequencies cover the whole head, those past
`partial_rotary_factor` of it zero (cos 1, sin 0: those dims pass unrotated), so the table is a plain one.

Ministral 3 scales each query after the rotation by a factor of its position (`ModelConfig.query_scale_beta`): the
table then carries it as a third entry, `[b, 1, s, 1]`, which the attention multiplies the rotated queries by.

With a partial rotary factor (Phi-4-mini: 0.75) the tables cover the first `cfg.rotary_dim`
dims of a head only; `kernels.rope` leaves the rest as they are.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..config import ModelConfig


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str | None = None, dim: int | None = None):
        super().__init__()
        hf = cfg.hf_config
        params = dict(getattr(hf, "rope_parameters", None) or {})
        if layer_type is not None:
            params = dict(params[layer_type])
        self.kw = {"layer_type": layer_type} if layer_type is not None else {}
        self.query_scale = (cfg.query_scale_beta, cfg.query_scale_period) if cfg.query_scale_beta is not None else None
        self.rope_type = params.get("rope_type", "default")
        self.hf = hf
        if self.rope_type == "default":
            inv_freq, self.scaling = _default_inv_freq(params.get("rope_theta", 10000.0), dim or cfg.rotary_dim), 1.0
        else:
            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[self.rope_type](hf, None, **self.kw)
        # A plain attribute, not a buffer: `module.to(bf16)` must not round the frequencies.
        self.inv_freq = inv_freq.float()
        if self.rope_type == "longrope":
            self.original_max = params["original_max_position_embeddings"]
            self.long_inv_freq = ROPE_INIT_FUNCTIONS["longrope"](hf, None, seq_len=self.original_max + 1,
                                                                 **self.kw)[0].float()
        # One copy per device, made on first use: a host-to-device copy every forward is a sync.
        self._inv_freq_on: dict[tuple[torch.device, bool], torch.Tensor] = {}

    def _inv_freq_for(self, position_ids: torch.Tensor) -> torch.Tensor:
        if self.rope_type == "dynamic":  # only dynamic NTK reads the length (a host sync on GPUs)
            seq_len = int(position_ids.max()) + 1
            if seq_len > self.hf.max_position_embeddings:
                inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](self.hf, position_ids.device, seq_len=seq_len, **self.kw)
                return inv_freq.float()
        # LongRoPE's long set past the original context (a host sync too)
        long = self.rope_type == "longrope" and int(position_ids.max()) + 1 > self.original_max
        key = (position_ids.device, long)
        if key not in self._inv_freq_on:
            self._inv_freq_on[key] = (self.long_inv_freq if long else self.inv_freq).to(key[0])
        return self._inv_freq_on[key]

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin of shape `[b, s, rotary_dim]` for `position_ids` `[b, s]` (and the query scale, where set)."""
        inv_freq = self._inv_freq_for(position_ids)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        tables = (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)
        if self.query_scale is None:
            return tables
        beta, period = self.query_scale  # in fp32 and then rounded to the queries' dtype, as transformers does
        scale = 1 + beta * torch.log(1 + torch.floor(position_ids / period))
        return *tables, scale[:, None, :, None].to(dtype)

