"""Document-causal attention (models/document_attention.py), selective recompute and the RoPE cache.

flex_attention has no backward on CPU (torch 2.13), so its forward is checked here
against the dense mask and its backward in tests/test_gpu.py. The dense path's
packed == unpacked losses are in tests/test_data_batches.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from bounds import FP32_EPS, ROUNDING_FACTOR, assert_close, rounding_bound, within

from helpers import logit_bound, make_ps
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.data.microbatch import MicroBatch
from hfmeg.errors import LayoutError
from hfmeg.models.document_attention import (DocumentMask, MaskPlanner, _sunk, attend, document_causal_mask,
                                             flex_applies, layer_mask, plan, split_block_mask,
                                             split_causal_mask)
from hfmeg.parallel.activation_meter import SavedTensorMeter
from tiny_models import save_tiny

# Row 0: three documents, the second crossing the 128-token block boundary, then padding (0);
# row 1: one document filling the row.
SEGMENTS = torch.tensor([[1] * 50 + [2] * 100 + [3] * 30 + [0] * 20, [1] * 200])


def _qkv(heads=8, kv_heads=2, s=200, d=16, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    shapes = ((2, heads, s, d), (2, kv_heads, s, d), (2, kv_heads, s, d))
    return [torch.randn(*sh, generator=g).requires_grad_(requires_grad) for sh in shapes]


def test_flex_block_mask_forward_equals_dense_mask():
    q, k, v = _qkv()
    flex, dense = plan(SEGMENTS, flex=True), plan(SEGMENTS, flex=False)
    assert flex.block is not None and flex.dense is None
    assert torch.equal(dense.dense, document_causal_mask(SEGMENTS))
    _flex_within_rounding_of_dense(q, k, v, flex, dense)


def _flex_within_rounding_of_dense(q, k, v, flex: DocumentMask, dense: DocumentMask, softcap=None, sinks=None) -> None:
    run = dict(scale=0.25, gqa=True, softcap=softcap)
    with torch.no_grad():
        got = attend(q, k, v, flex, sinks=sinks, **run)
        want = attend(q, k, v, dense, sinks=sinks, **run)
        exact = attend(q.double(), k.double(), v.double(), dense, sinks=None if sinks is None else sinks.double(), **run)
    # Both are fp32 softmax-weighted sums of the same values in other blockings: each within rounding of the
    # float64 result, as far as the dense fp32 path is (times ROUNDING_FACTOR, twice: two fp32 runs) + 4 eps.
    rounding = (want.double() - exact).abs().max().item()
    bound = 2 * (ROUNDING_FACTOR * rounding + 4 * FP32_EPS * exact.abs().max().item())
    within((got - want).abs().max().item(), bound, "flex vs dense (rounding)")


def test_softcapped_scores_in_flex_and_dense_attention():
    """Soft-capped scores (Gemma: cap * tanh(s / cap)): flex's score_mod and the explicit dense path agree
    (forward, on CPU), the dense path is transformers' formula, and the cap changes the result."""
    q, k, v = _qkv()
    flex, dense = plan(SEGMENTS, flex=True), plan(SEGMENTS, flex=False)
    _flex_within_rounding_of_dense(q, k, v, flex, dense, softcap=0.5)
    causal = torch.ones(200, 200, dtype=torch.bool).tril()

    def formula(mask, dtype):  # transformers' soft-capped eager attention, written out
        qd, kr, vr = q.to(dtype), k.to(dtype).repeat_interleave(4, 1), v.to(dtype).repeat_interleave(4, 1)
        s = torch.tanh(qd @ kr.transpose(2, 3) * 0.25 / 0.5) * 0.5
        return torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ vr

    with torch.no_grad():
        capped = attend(q, k, v, dense, scale=0.25, gqa=True, softcap=0.5)
        for got, mask in ((capped, dense.dense),  # one document: the causal mask
                          (attend(q, k, v, None, scale=0.25, gqa=True, softcap=0.5), causal)):
            want = formula(mask, torch.float32)
            assert_close(got, want, rtol=0, atol=rounding_bound(want, formula(mask, torch.float64)))
        assert (capped - attend(q, k, v, dense, scale=0.25, gqa=True)).abs().max() > 1e-2
    # Where flex applies, a capped model's one-document rows take a causal block mask (not s² dense scores).
    from torch.nn.attention.flex_attention import create_mask
    causal_block = MaskPlanner(torch.device("cpu"), 1, 0, True, torch.float32, explicit=True).mask(None, 200)
    assert torch.equal(create_mask(causal_block.block.mask_mod, 1, None, 200, 200), causal[None, None])
    _flex_within_rounding_of_dense(q, k, v, causal_block, DocumentMask(dense=causal[None, None]), softcap=0.5)
    assert MaskPlanner(torch.device("cpu"), 1, 0, True, torch.float32).mask(None, 200) is None


def test_attention_sinks_in_flex_and_dense_attention():
    """gpt-oss's sinks (a logit per head in each query's normaliser): flex's output rescaled by its logsumexp and
    the explicit path's extra softmax column agree (forward, on CPU), the explicit path is transformers' eager
    formula, and the sinks change the result; the rescaling (`_sunk`) gives the explicit path's gradients of q, k,
    v and the sinks (float64) when fed a logsumexp computed with autograd, as flex's backward takes one."""
    q, k, v = _qkv()
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(1))
    flex, dense = plan(SEGMENTS, flex=True), plan(SEGMENTS, flex=False)
    _flex_within_rounding_of_dense(q, k, v, flex, dense, sinks=sinks)
    _flex_within_rounding_of_dense(q, k, v, flex, dense, softcap=0.5, sinks=sinks)
    def formula(dtype):  # transformers' eager attention with sinks, written out
        qd, kr, vr = q.to(dtype), k.to(dtype).repeat_interleave(4, 1), v.to(dtype).repeat_interleave(4, 1)
        s = (qd @ kr.transpose(2, 3) * 0.25).masked_fill(~dense.dense, float("-inf"))
        combined = torch.cat([s, sinks.to(dtype).view(1, -1, 1, 1).expand(2, 8, 200, 1)], dim=-1)
        return torch.softmax(combined, -1)[..., :-1] @ vr

    with torch.no_grad():
        got, want = attend(q, k, v, dense, scale=0.25, gqa=True, sinks=sinks), formula(torch.float32)
        assert_close(got, want, rtol=0, atol=rounding_bound(want, formula(torch.float64)))
        assert (got - attend(q, k, v, dense, scale=0.25, gqa=True)).abs().max() > 1e-2
    q, k, v = (t.double().requires_grad_() for t in _qkv(s=40))
    sinks = sinks.double().requires_grad_()
    mask = document_causal_mask(SEGMENTS[:, :40])
    explicit = attend(q, k, v, DocumentMask(dense=mask), scale=0.25, gqa=True, sinks=sinks)
    kr, vr = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    scores = (q @ kr.transpose(2, 3) * 0.25).masked_fill(~mask, float("-inf"))
    rescaled = _sunk(torch.softmax(scores, -1) @ vr, torch.logsumexp(scores, -1), sinks)
    # Two float64 orders of the same sums (k eps of the terms summed, both sides): an output sums 40 keys' terms
    # (scores, softmax, values: 80 roundings); a gradient adds the backward's 40 and, for k, v and the sinks, the 4
    # query heads x 40 queries of a KV head (240 in all), each rounding to an eps64 of the result's size.
    eps64 = torch.finfo(torch.float64).eps
    assert_close(rescaled, explicit, rtol=0, atol=2 * 80 * eps64 * explicit.abs().max().item())
    g = torch.randn_like(explicit)
    for a, b in zip(torch.autograd.grad(rescaled, (q, k, v, sinks), g), torch.autograd.grad(explicit, (q, k, v, sinks), g)):
        assert_close(a, b, rtol=0, atol=2 * 240 * eps64 * b.abs().max().item())


@pytest.mark.parametrize("packed", [True, False])
def test_windowed_layers_attend_under_the_window_in_both_mask_forms(packed):
    """The planner's second mask (`DocumentMask.sliding`) for rows longer than the window, packed or one
    document a row: the dense one is the windowed document mask, flex's computes the same (forward, on CPU);
    the full-attention layers keep the plain mask, and rows within the window get no second mask."""
    q, k, v = _qkv()
    seg = SEGMENTS if packed else None
    masks = {flex: MaskPlanner(torch.device("cpu"), 1, 0, flex, torch.float32, window=37).mask(seg, 200)
             for flex in (True, False)}
    for flex, docs in masks.items():
        assert layer_mask(docs, None, 200) is docs and layer_mask(docs, 37, 200) is docs.sliding
        assert (docs.block is None and docs.dense is None) == (not packed)  # full layers: plain causal
    want = document_causal_mask(SEGMENTS if packed else torch.ones(1, 200, dtype=torch.long), 37)
    assert torch.equal(masks[False].sliding.dense, want)
    assert want.sum() < document_causal_mask(SEGMENTS if packed else torch.ones(1, 200, dtype=torch.long)).sum()
    _flex_within_rounding_of_dense(q, k, v, masks[True].sliding, masks[False].sliding)
    within_window = MaskPlanner(torch.device("cpu"), 1, 0, False, torch.float32, window=200).mask(seg, 200)
    assert within_window is None if not packed else (within_window.sliding is None and
                                                     torch.equal(within_window.dense, plan(seg, flex=False).dense))
    with pytest.raises(LayoutError, match="longer than the sliding window 37"):
        layer_mask(plan(seg, flex=False), 37, 200)


def test_single_document_rows_use_plain_causal_attention_with_the_same_result():
    assert plan(None, flex=True) is None
    one_doc = torch.full((2, 200), 3)
    assert plan(one_doc, flex=True) is None and plan(one_doc, flex=False) is None
    q, k, v = _qkv(requires_grad=True)
    causal = attend(q, k, v, None, scale=0.25, gqa=True)
    masked = attend(q, k, v, DocumentMask(dense=document_causal_mask(one_doc)), scale=0.25, gqa=True)
    g = torch.randn_like(causal)
    # Two kernels (SDPA's causal flag, an explicit mask) in fp32: each within rounding of the float64 run.
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    exact = attend(q64, k64, v64, None, scale=0.25, gqa=True)
    assert_close(causal, masked, rtol=0, atol=rounding_bound(causal, exact))
    exact_grads = torch.autograd.grad(exact, (q64, k64, v64), g.double())
    for a, b, c in zip(torch.autograd.grad(causal, (q, k, v), g), torch.autograd.grad(masked, (q, k, v), g), exact_grads):
        assert_close(a, b, rtol=0, atol=rounding_bound(a, c))


def test_one_document_rows_with_segment_ids_match_transformers(tmp_path):
    folder = save_tiny("llama3", tmp_path / "m")
    ps = make_ps(world=1)
    chunk = load_chunks(HFCheckpoint(folder), ps)[0]
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        got = chunk(ids, segment_ids=torch.ones_like(ids))[..., :300]
        want = ref(ids).logits
        assert_close(got, want, rtol=0, atol=logit_bound(folder, ids, want, attn_implementation="sdpa"))


def _layer_calls(chunk, ids, labels):
    """Forward + backward of `chunk`; calls of each attention piece, gradients, peak saved bytes."""
    calls = {"qkv": 0, "out": 0, "core": 0}
    hooks = []
    for layer in chunk.layers.values():
        for name in ("qkv", "out"):
            hooks.append(getattr(layer.attn, name).register_forward_hook(
                lambda *_, n=name: calls.__setitem__(n, calls[n] + 1)))
        core = layer.attn._core

        def counted(*args, core=core):
            calls["core"] += 1
            return core(*args)

        layer.attn._core = counted
    meter = SavedTensorMeter([chunk])
    with meter.hooks():
        loss = chunk(ids, labels=labels, segment_ids=SEGMENTS[:, :ids.shape[1]]).sum()
    loss.backward()
    for h in hooks:
        h.remove()
    return calls, {n: p.grad for n, p in chunk.named_parameters()}, meter.peak


def test_selective_recompute_reruns_only_rope_and_attention(tmp_path):
    folder = save_tiny("llama3", tmp_path / "m")
    ps = make_ps(world=1)
    ids = torch.randint(0, 300, (2, 200), generator=torch.Generator().manual_seed(2))
    labels = torch.roll(ids, -1, 1)
    runs = {mode: _layer_calls(load_chunks(HFCheckpoint(folder), ps, recompute=mode)[0], ids, labels)
            for mode in ("none", "selective", "full")}
    layers = 2
    assert runs["none"][0] == {"qkv": layers, "out": layers, "core": layers}
    # The projections (and, under TP/SP, their collectives) run once; only the core runs again.
    assert runs["selective"][0] == {"qkv": layers, "out": layers, "core": 2 * layers}
    assert runs["full"][0] == {"qkv": 2 * layers, "out": 2 * layers, "core": 2 * layers}
    for mode in ("selective", "full"):
        for name, g in runs["none"][1].items():
            assert_close(runs[mode][1][name], g, rtol=0, atol=0, msg=f"{mode} {name}")
    assert runs["full"][2] < runs["selective"][2] < runs["none"][2]


def test_rope_frequencies_are_copied_to_a_device_once(tmp_path):
    chunk = load_chunks(HFCheckpoint(save_tiny("qwen2", tmp_path / "m")), make_ps(world=1))[0]
    positions = torch.arange(8, device="meta")[None]
    first = chunk.rope._inv_freq_for(positions)
    assert first.device.type == "meta" and chunk.rope._inv_freq_for(positions) is first



cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (flex_attention backward)")


@pytest.mark.gpu
@cuda
def test_flex_attention_forward_and_backward_equal_dense_mask_on_cuda():
    for dtype, tol in ((torch.float32, 2e-4), (torch.bfloat16, 3e-2)):
        q, k, v = (t.to("cuda", dtype).requires_grad_() for t in _qkv())
        seg = SEGMENTS.cuda()
        flex = plan(seg, flex=True)
        assert flex.block is not None
        got = attend(q, k, v, flex, scale=0.25, gqa=True)
        want = attend(q, k, v, DocumentMask(dense=document_causal_mask(seg)), scale=0.25, gqa=True)
        assert_close(got, want, rtol=tol, atol=tol)
        g = torch.randn_like(got)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
            assert_close(a, b, rtol=tol, atol=tol)


def test_flex_only_where_it_has_a_kernel():
    assert flex_applies(torch.device("cuda", 0), 16) and flex_applies(torch.device("cuda", 0), 128)
    assert not flex_applies(torch.device("cuda", 0), 8)  # Triton's flex kernels refuse heads under 16
    assert not flex_applies(torch.device("cpu"), 128)  # no backward on CPU


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("heads", [4, 8])  # head_dim 16 takes flex_attention, 8 the dense mask
@pytest.mark.parametrize("kind", ["llama3", "mistral"])  # mistral: a sliding window of 4 tokens
def test_packed_rows_on_cuda_match_the_cpu_dense_path(tmp_path, heads, kind):
    folder = save_tiny(kind, tmp_path / "m", num_attention_heads=heads, num_key_value_heads=2)
    ids = torch.randint(0, 300, (2, 200), generator=torch.Generator().manual_seed(3))
    labels, pos = torch.roll(ids, -1, 1), torch.arange(200).expand(2, 200)
    losses = []
    for device in ("cpu", "cuda"):
        chunk = load_chunks(HFCheckpoint(folder), make_ps(world=1, device=device))[0]
        with torch.no_grad():
            losses.append(chunk(ids.to(device), labels=labels.to(device), position_ids=pos.to(device),
                                segment_ids=SEGMENTS.to(device)).cpu())
    assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-4)


def test_the_executor_decides_single_document_rows_on_the_host(tmp_path, monkeypatch):
    """Staging (models/staging.py) passes `segment_ids` only for micro-batches with packed rows, so the model
    never reads a bool back from the device to find out (the check runs on the host tensor, before any copy)."""
    import hfmeg.models.document_attention as document_attention
    from hfmeg.parallel.pipeline import forward_backward

    seen = []
    real = document_attention.plan
    monkeypatch.setattr(document_attention, "plan", lambda seg, flex: seen.append(seg) or real(seg, flex=flex))
    ps = make_ps(world=1)
    chunks = load_chunks(HFCheckpoint(save_tiny("llama3", tmp_path / "m")), ps)
    ids = torch.randint(0, 300, (2, 200))
    packed = MicroBatch(input_ids=ids, labels=ids, position_ids=torch.arange(200).expand(2, 200),
                        segment_ids=SEGMENTS)
    single = replace(packed, segment_ids=torch.full((2, 200), 1))
    forward_backward(chunks, ps, [single, packed], schedule="1f1b", num_tokens=800, forward_only=True)
    assert seen[0] is None and torch.equal(seen[1], SEGMENTS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_planning_a_packed_mask_on_the_gpu_makes_no_host_sync():
    seg = SEGMENTS.cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert plan(seg, flex=False).dense is not None
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_attention_sinks_in_compiled_flex_forward_and_backward_on_cuda():
    """gpt-oss's sinks through the compiled flex kernel: its log-sum-exp and the backward through it (`_sunk`), the
    output and the gradients of q, k, v and the sinks against the explicit path's, fp32, packed rows across tiles."""
    q, k, v = (t.cuda().requires_grad_() for t in _qkv(d=64))
    sinks = torch.randn(8, device="cuda", requires_grad=True)
    outs = []
    for docs in (plan(SEGMENTS.cuda(), flex=True), plan(SEGMENTS.cuda(), flex=False)):
        o = attend(q, k, v, docs, 64 ** -0.5, gqa=True, sinks=sinks)
        outs.append((o, *torch.autograd.grad(o, (q, k, v, sinks), torch.ones_like(o))))
    for got, ref in zip(*outs):  # fp32, two kernels' summation orders
        assert (got - ref).abs().max() <= 1e-4 * ref.abs().max().clamp_min(1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_windowed_soft_capped_flex_compiles_as_one_graph_on_cuda():
    """Gemma 2's attention as training runs it on a GPU: packed documents, a sliding window shorter than them
    and soft-capped scores through flex_attention, inside a `torch.compile(fullgraph=True)` region (a graph
    break raises), forward and backward against the explicit path under the dense windowed mask; fp32, two
    kernels' summation orders (the sinks test's bound)."""
    q, k, v = (t.cuda().requires_grad_() for t in _qkv(d=64))
    seg = SEGMENTS.cuda()
    index = torch.arange(seg.shape[1], device="cuda")
    window, cap, scale = 37, 0.5, 64 ** -0.5  # the cap bites: scores reach ~1
    block = split_block_mask(index, index, seg, seg, window)
    dense = DocumentMask(dense=split_causal_mask(index, index, seg, seg, window))
    compiled = torch.compile(lambda q, k, v: attend(q, k, v, block, scale, gqa=True, softcap=cap), fullgraph=True)
    outs = []
    for run in (compiled, lambda q, k, v: attend(q, k, v, dense, scale, gqa=True, softcap=cap)):
        o = run(q, k, v)
        outs.append((o, *torch.autograd.grad(o, (q, k, v), torch.ones_like(o))))
    for got, ref in zip(*outs):
        assert (got - ref).abs().max() <= 1e-4 * ref.abs().max().clamp_min(1.0)


def _split_block_mask_matches_dense(device: str) -> None:
    """Each CP rank's flex block mask (`split_block_mask`: its queries over the gathered keys) against the dense
    split mask: element by element, and through `attend` forward and backward (flex vs SDPA), with documents of
    lengths that cross the 128-token blocks and the 2·CP chunk boundaries, and without documents; with a sliding window too."""
    from torch.nn.attention.flex_attention import create_mask

    from hfmeg.models.document_attention import plan_split
    from hfmeg.parallel.context import gathered_index, token_index

    s, b, heads, kv_heads, d = 1024, 2, 8, 2, 64
    lengths = ((300, 77, 129, 400, 118), (1024,))  # row 2: one document
    seg = torch.cat([torch.repeat_interleave(torch.arange(1, len(n) + 1), torch.tensor(n)).unsqueeze(0)
                     for n in lengths]).to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    for cp, window in ((2, None), (4, None), (2, 200)):
        kv_index = gathered_index(s, cp, device)
        for rank in range(cp):
            q_index = token_index(s, cp, rank, device)
            for segs in ((seg.index_select(1, q_index), seg.index_select(1, kv_index)), (None, None)):
                block = plan_split(q_index, kv_index, *segs, flex=True, dtype=torch.float32, window=window)
                dense = plan_split(q_index, kv_index, *segs, flex=False, dtype=torch.float32, window=window)
                rows = b if segs[0] is not None else 1
                elements = create_mask(block.block.mask_mod, rows, None, len(q_index), s, device=device)
                assert torch.equal(elements, split_causal_mask(q_index, kv_index, *segs, window)), (cp, rank)
                q = torch.randn(b, heads, len(q_index), d, device=device, generator=gen, requires_grad=True)
                k, v = (torch.randn(b, kv_heads, s, d, device=device, generator=gen, requires_grad=True)
                        for _ in range(2))
                outs = []
                for mask in (block, dense):
                    o = attend(q, k, v, mask, d ** -0.5, gqa=True)
                    grads = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
                    outs.append((o, *grads))
                for got, ref in zip(*outs):  # fp32, two kernels' summation orders
                    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max().clamp_min(1.0), (cp, rank)


def _tiles(block, which: str, shape) -> torch.Tensor:
    """A BlockMask's partial (`kv`) or full (`full_kv`) key tiles per query tile, as booleans `[b, nq, nk]`."""
    num, idx = getattr(block, f"{which}_num_blocks")[:, 0], getattr(block, f"{which}_indices")[:, 0]
    out = torch.zeros(shape, dtype=torch.bool)
    for r in range(shape[0]):
        for i in range(shape[1]):
            out[r, i, idx[r, i, : num[r, i]].long()] = True
    return out


def _check_tiles(q_index, kv_index, q_seg, kv_seg, exact_tiles: bool, window: int | None = None) -> None:
    """The range-classified block mask against the per-element truth: the mask flex computes with it (full
    tiles whole, partial tiles through the mask function, the rest skipped) is the dense mask, and its tiles
    are create_block_mask's (which scans every element) where `exact_tiles`, else a superset of them; with
    and without a sliding `window`."""
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    from hfmeg.models.document_attention import split_block_mask, split_causal_mask

    sq, skv = len(q_index), len(kv_index)
    b = q_seg.shape[0] if q_seg is not None else 1
    block = split_block_mask(q_index, kv_index, q_seg, kv_seg, window).block
    shape = (b, -(-sq // 128), -(-skv // 128))
    partial, full = _tiles(block, "kv", shape), _tiles(block, "full_kv", shape)
    assert not (partial & full).any()
    elements = create_mask(block.mask_mod, b, None, sq, skv)[:, 0]
    expand = lambda t: t.repeat_interleave(128, 1)[:, :sq].repeat_interleave(128, 2)[:, :, :skv]  # noqa: E731
    flex_sees = expand(full) | (expand(partial) & elements)
    want = split_causal_mask(q_index, kv_index, q_seg, kv_seg, window)[:, 0].expand(b, -1, -1)
    assert torch.equal(flex_sees, want)
    scan = create_block_mask(block.mask_mod, b if q_seg is not None else None, None, sq, skv, device="cpu")
    scanned = _tiles(scan, "kv", shape) | _tiles(scan, "full_kv", shape)
    if exact_tiles:
        assert torch.equal(partial | full, scanned)
        whole = torch.zeros(shape, dtype=torch.bool)
        whole[:, : sq // 128, : skv // 128] = True
        assert torch.equal(full & whole, _tiles(scan, "full_kv", shape) & whole)
    else:
        assert not (scanned & ~(partial | full)).any()


@pytest.mark.parametrize("window", [None, 1, 100, 300])
def test_block_mask_tiles_from_ranges_are_exact_on_packed_rows(window):
    """Packed rows (consecutive documents, padding last), whole rows and CP splits whose chunks are whole
    tiles, with and without sliding windows shorter than the documents and than a tile: the tiles computed
    are exactly those a per-element scan finds, and the mask flex sees is exact."""
    from hfmeg.parallel.context import gathered_index, token_index

    index = torch.arange(200)
    _check_tiles(index, index, SEGMENTS, SEGMENTS, exact_tiles=True, window=window)  # a short last tile
    s = 1024
    lengths = ((300, 77, 129, 400, 118), (1024,), (500, 400, 100, 24))
    seg = torch.cat([torch.repeat_interleave(torch.arange(1, len(n) + 1), torch.tensor(n)).unsqueeze(0)
                     for n in lengths])
    seg[2, -24:] = 0  # padding
    index = torch.arange(s)
    _check_tiles(index, index, seg, seg, exact_tiles=True, window=window)
    _check_tiles(index, index, None, None, exact_tiles=True, window=window)
    for cp in (2, 4):  # chunks of 256 and 128 tokens
        kv_index = gathered_index(s, cp)
        for rank in range(cp):
            q_index = token_index(s, cp, rank)
            _check_tiles(q_index, kv_index, seg[:, q_index], seg[:, kv_index], exact_tiles=True, window=window)


def test_block_mask_from_ranges_is_exact_for_any_ids_and_splits():
    """Chunks that are not whole tiles (CP 4 over 1000 tokens: 125-token chunks) and ids in no order: the
    mask is still exact, the tiles a superset of the scan's."""
    from hfmeg.parallel.context import gathered_index, token_index

    g = torch.Generator().manual_seed(0)
    s, cp = 1000, 4
    seg = torch.randint(0, 6, (2, s), generator=g).sort(dim=1).values
    shuffled = torch.randperm(6, generator=g)[seg]  # the same documents, ids in no order
    kv_index = gathered_index(s, cp)
    for ids, window in ((seg, None), (shuffled, None), (seg, 150), (shuffled, 37)):
        for rank in range(cp):
            q_index = token_index(s, cp, rank)
            _check_tiles(q_index, kv_index, ids[:, q_index], ids[:, kv_index], exact_tiles=False, window=window)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_split_block_mask_equals_the_dense_split_mask_on_the_gpu():
    _split_block_mask_matches_dense("cuda")
