"""Gemma 4's shared keys and values carried between pipeline stages (KV sharing, `models/attention.py`).

A layer that reuses an earlier layer's keys and values may sit on a later pipeline stage than that layer. The
keys and values then travel with the activations, as the per-layer inputs do (`models/per_layer_inputs.py`):
every stage boundary carries, after the hidden state (and the per-layer inputs), the keys and values of every
producing layer (`ModelConfig.stores_kv`), those not yet computed as zeros, so every boundary has one width and
the pipeline one buffer shape. A chunk takes the ones its earlier stages made into its `kv_store` and sends on what
its `kv_store` then holds. Their gradients travel back with the activation's: the reader's use of a producer's
keys reaches the producer's projection through the pipeline's backward, summed with the producer's own use.

What is carried is what the reader attends with: a producer's `[b, groups, S, d]` keys and values as this rank
holds them (its KV groups, copies included where KV heads are replicated over TP; the whole row's S tokens under
context parallelism, all of them under sequence parallelism), folded into the activation's `[s, b, features]`
shape (`s` the rank's token count: S = s * cp * (tp under SP)), each rank sending its own to the same TP/CP rank
of the next stage. So a boundary carries 2 * groups * d * cp (* tp under SP) features a token per producer.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..parallel.state import ParallelState


class SharedKV:
    """The producers' keys and values in a boundary's features, for one rank's layout."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState):
        self.fold = ps.cp * (ps.tp if ps.sequence_parallel else 1)  # S / s: the row's tokens per activation token
        self.shapes = {i: (cfg.local_kv_heads(ps.tp, i), cfg.attention_shape(i).head_dim)
                       for i in range(cfg.num_layers) if cfg.stores_kv(i)}  # producer -> (groups, d)

    @property
    def width(self) -> int:
        """The features a token carries for them."""
        return sum(2 * g * d * self.fold for g, d in self.shapes.values())

    def unpack(self, carried: torch.Tensor, kv_store: dict, before: int) -> None:
        """Put into `kv_store` the keys and values of the producers before layer `before` from `carried`
        `[s, b, width]`."""
        s, b = carried.shape[:2]
        for i, part in zip(self.shapes, carried.split(self._widths(), dim=-1)):
            if i < before:
                g, d = self.shapes[i]
                k, v = part.view(s, b, 2, self.fold, g, d).permute(2, 1, 4, 0, 3, 5).unbind(0)
                kv_store[i] = k.reshape(b, g, s * self.fold, d), v.reshape(b, g, s * self.fold, d)

    def pack(self, kv_store: dict, like: torch.Tensor) -> torch.Tensor:
        """The carried features `[s, b, width]` of `kv_store`'s keys and values (zeros for a producer not in it),
        `like` the activation `[s, b, ...]` they travel with."""
        s, b = like.shape[:2]
        parts = []
        for i, (g, d) in self.shapes.items():
            if i not in kv_store:
                parts.append(like.new_zeros(s, b, 2 * g * d * self.fold))
                continue
            kv = torch.stack(kv_store[i]).view(2, b, g, s, self.fold, d)  # S = s * fold, each token's fold together
            parts.append(kv.permute(3, 1, 0, 4, 2, 5).reshape(s, b, -1))
        return torch.cat(parts, dim=-1)

    def _widths(self) -> list[int]:
        return [2 * g * d * self.fold for g, d in self.shapes.values()]
