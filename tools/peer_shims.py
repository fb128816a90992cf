"""What the peers need from a torch older than they target, and what they leave out without their CUDA extras.

The GPU image has torch 2.11; torchtitan 0.3.0 targets a later torch and uses two names 2.11 lacks:

- `torch.distributed.fsdp.DataParallelMeshDims`, imported at module level by `torchtitan.distributed.full_dtensor`
  (which every model's parallelize module imports) but only *constructed* under `spmd_backend="full_dtensor"` or
  `"spmd_types"`. The default backend passes `dp_mesh_dims=None`. The stand-in is a class that refuses to be
  constructed, so a path that needs the real one fails loudly instead of silently mis-sharding.
- `create_block_mask(separate_full_blocks=...)`: torchtitan passes `separate_full_blocks=True` outside its
  batch-invariant mode. Older torch always separates the full blocks (the keyword only added a way to turn that
  off), so dropping the keyword when it is True is the same mask; False is refused.

Each shim is applied only where the name is missing (`apply_torchtitan_shims` returns what it did; nothing on a torch
that has both), before torchtitan is imported. tests/test_peer_shims.py simulates the missing names.

Megatron-Core without Transformer Engine or apex (the GPU image has neither) runs its local layer spec, whose
`DotProductAttention` materialises the s x s scores in fp32, and torch's AdamW without `fused`. `SdpaCoreAttention`
is a core-attention module for its spec that calls torch's SDPA (flash on a GPU), and `fuse_torch_adamw` turns on
torch's fused kernel in the optimizer it built.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F


class _MissingDataParallelMeshDims:
    """Stands in for torch.distributed.fsdp.DataParallelMeshDims (torch >= 2.12) on an older torch."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"torch {torch.__version__} has no torch.distributed.fsdp.DataParallelMeshDims: "
                           "torchtitan's full_dtensor / spmd_types backends need a newer torch")


def _accepts(fn, name: str) -> bool:
    return getattr(fn, "_peer_shim", False) or name in inspect.signature(fn).parameters


def _drop_separate_full_blocks(create):
    """`create` (a create_block_mask) for callers that pass `separate_full_blocks`, on a torch without it."""
    @functools.wraps(create)
    def call(*args, separate_full_blocks: bool = True, **kwargs):
        if not separate_full_blocks:
            raise RuntimeError(f"torch {torch.__version__}'s create_block_mask always separates full blocks: "
                               "torchtitan's batch-invariant mode needs a newer torch")
        return create(*args, **kwargs)
    call._peer_shim = True  # the shim itself takes the keyword (its signature shows the wrapped function's)
    return call


def apply_torchtitan_shims() -> list[str]:
    """Fill in what torchtitan 0.3 needs and this torch lacks; returns a line per shim applied (empty: none)."""
    import torch.distributed.fsdp as fsdp
    from torch.nn.attention import flex_attention

    applied = []
    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = _MissingDataParallelMeshDims
        applied.append("torch.distributed.fsdp.DataParallelMeshDims: a stand-in that refuses construction")
    if not _accepts(flex_attention.create_block_mask, "separate_full_blocks"):
        # torchtitan compiles create_block_mask at import (`torch.compile(create_block_mask)`, a global name
        # bound then): the module attribute must be the wrapper before torchtitan's attention module loads.
        flex_attention.create_block_mask = _drop_separate_full_blocks(flex_attention.create_block_mask)
        applied.append("create_block_mask: separate_full_blocks=True dropped (older torch always separates)")
    return applied


class SdpaCoreAttention(torch.nn.Module):
    """Megatron-Core core attention through `F.scaled_dot_product_attention` (causal, no dropout).

    Takes what Megatron's `SelfAttention` passes its `core_attention` (its constructor keywords; query, key, value
    as `[s, b, heads, head_dim]`, K/V with as many heads as there are query groups) and returns `[s, b, heads *
    head_dim]` as its `DotProductAttention` does. Causal only: no padding mask, bias or packed sequences (those need
    Transformer Engine's attention), refused rather than ignored."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__()
        if getattr(attn_mask_type, "name", str(attn_mask_type)) != "causal":
            raise ValueError(f"SdpaCoreAttention is causal only, got attn_mask_type={attn_mask_type}")
        if getattr(config, "context_parallel_size", 1) != 1:
            raise ValueError("SdpaCoreAttention has no context parallelism")
        self.config = config
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SdpaCoreAttention takes no attention bias or packed sequences")
        s, b, heads, dim = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                             enable_gqa=k.shape[1] != heads)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * dim)


def fuse_torch_adamw(optimizer) -> int:
    """Turn on torch's fused AdamW kernel in every torch Adam/AdamW that `optimizer` (Megatron's, possibly chained
    or distributed) wraps; returns how many param groups were switched. Megatron falls back to torch's optimizer
    without TE or apex and leaves it on the default (foreach) kernel; the step reads `fused` from the group."""
    switched = 0
    stack, seen = [optimizer], set()
    while stack:
        opt = stack.pop()
        if id(opt) in seen:
            continue
        seen.add(id(opt))
        if isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
            for group in opt.param_groups:
                group["fused"], group["foreach"] = True, False
                switched += 1
            continue
        stack.extend(getattr(opt, "chained_optimizers", []))
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            stack.append(inner)
    return switched
