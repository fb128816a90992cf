"""tools/peer_shims.py: the torchtitan shims for an older torch, tested by taking the names away from this torch;
Megatron-Core's SDPA core attention against a float64 reference and the fused-AdamW switch, without Megatron."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.fsdp as fsdp
from torch.nn.attention import flex_attention

from bounds import assert_close
from tool_loader import load_tool


@pytest.fixture
def shims():
    return load_tool("peer_shims")


def _old_create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, _compile=False):
    """create_block_mask as torch 2.11 has it: no separate_full_blocks (full blocks always separated)."""
    return _REAL_CREATE(mask_mod, B, H, Q_LEN, KV_LEN, device=device, BLOCK_SIZE=BLOCK_SIZE, _compile=_compile)


_REAL_CREATE = flex_attention.create_block_mask


def _causal(b, h, q, kv):
    return q >= kv


def test_on_an_older_torch_both_names_are_filled_in(shims, monkeypatch):
    monkeypatch.delattr(fsdp, "DataParallelMeshDims", raising=False)
    monkeypatch.setattr(flex_attention, "create_block_mask", _old_create_block_mask)
    applied = shims.apply_torchtitan_shims()
    assert len(applied) == 2 and "DataParallelMeshDims" in applied[0] and "create_block_mask" in applied[1]

    # torchtitan imports the name at module level; building one (its full_dtensor backends) is refused, loudly
    from torch.distributed.fsdp import DataParallelMeshDims
    with pytest.raises(RuntimeError, match="DataParallelMeshDims"):
        DataParallelMeshDims(shard="fsdp", replicate=None)

    # the keyword torchtitan passes is taken; True gives the mask the old torch builds (it always separates)
    create = flex_attention.create_block_mask
    mask = create(_causal, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=128, separate_full_blocks=True)
    want = _REAL_CREATE(_causal, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=128)
    assert torch.equal(mask.to_dense(), want.to_dense())
    assert torch.equal(mask.full_kv_num_blocks, want.full_kv_num_blocks)  # the diagonal-free block is "full"
    with pytest.raises(RuntimeError, match="batch-invariant"):
        create(_causal, 1, 1, 256, 256, device="cpu", separate_full_blocks=False)

    assert shims.apply_torchtitan_shims() == []  # idempotent: both names are there now


def test_on_a_torch_that_has_both_nothing_is_touched(shims, monkeypatch):
    if not hasattr(fsdp, "DataParallelMeshDims"):
        pytest.skip(f"torch {torch.__version__} lacks DataParallelMeshDims: the shim's case, tested above")
    before = (fsdp.DataParallelMeshDims, flex_attention.create_block_mask)
    assert shims.apply_torchtitan_shims() == []
    assert (fsdp.DataParallelMeshDims, flex_attention.create_block_mask) == before


def _reference_attention(q, k, v, scale):
    """float64 causal attention on [s, b, heads, dim] (K/V heads repeated for grouped queries) -> [s, b, h * d]."""
    s, b, heads, dim = q.shape
    rep = heads // k.shape[2]
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    return (scores.softmax(-1) @ v).permute(2, 0, 1, 3).reshape(s, b, heads * dim)


@pytest.mark.parametrize("kv_heads, scale", [(4, None), (2, 0.3)])
def test_sdpa_core_attention_is_causal_attention_in_megatrons_layout(shims, kv_heads, scale):
    from types import SimpleNamespace
    causal = SimpleNamespace(name="causal")  # Megatron's AttnMaskType.causal, by its name
    attn = shims.SdpaCoreAttention(SimpleNamespace(context_parallel_size=1), layer_number=1,
                                   attn_mask_type=causal, attention_type="self", softmax_scale=scale)
    g = torch.Generator().manual_seed(0)
    s, b, heads, dim = 12, 2, 4, 8
    q = torch.randn(s, b, heads, dim, generator=g)
    k, v = (torch.randn(s, b, kv_heads, dim, generator=g) for _ in range(2))
    out = attn(q, k, v, None, attn_mask_type=causal)
    assert out.shape == (s, b, heads * dim)
    # fp32 against float64: softmax weights sum to 1, so each output is a convex mix of |v| <~ 4 values over at
    # most s keys; a few eps of the dot products (dim terms) and of the mix (s terms)
    eps = torch.finfo(torch.float32).eps
    assert_close(out.double(), _reference_attention(q, k, v, scale or 1 / math.sqrt(dim)), rtol=0,
                 atol=8 * (dim + s) * eps * 4, what="sdpa core attention vs float64")


def test_sdpa_core_attention_refuses_what_it_does_not_do(shims):
    from types import SimpleNamespace
    config = SimpleNamespace(context_parallel_size=1)
    with pytest.raises(ValueError, match="causal only"):
        shims.SdpaCoreAttention(config, 1, SimpleNamespace(name="padding"), "self")
    attn = shims.SdpaCoreAttention(config, 1, SimpleNamespace(name="causal"), "self")
    x = torch.zeros(4, 1, 2, 8)
    with pytest.raises(ValueError, match="packed"):
        attn(x, x, x, None, packed_seq_params=object())


def test_fuse_torch_adamw_switches_every_wrapped_optimizer_to_the_fused_kernel(shims):
    from types import SimpleNamespace

    def params(seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.nn.Parameter(torch.randn(5, 3, generator=g)) for _ in range(2)]

    ours = [torch.optim.AdamW(params(s), lr=0.1, weight_decay=0.1) for s in (1, 2)]
    # Megatron's shapes: a chained optimizer over distributed ones, each holding a torch optimizer
    wrapped = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=ours[0]),
                                                  SimpleNamespace(optimizer=ours[1])])
    assert shims.fuse_torch_adamw(wrapped) == 2
    assert all(g["fused"] and not g["foreach"] for o in ours for g in o.param_groups)
    for seed, opt in zip((1, 2), ours):
        ref = torch.optim.AdamW(params(seed), lr=0.1, weight_decay=0.1, fused=True)
        for o in (opt, ref):
            for p in o.param_groups[0]["params"]:
                p.grad = torch.full_like(p, 0.5)
            o.step()
        for p, r in zip(opt.param_groups[0]["params"], ref.param_groups[0]["params"]):
            assert torch.equal(p, r)  # the same kernel on the same numbers: bitwise
