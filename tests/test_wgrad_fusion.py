"""Gradient-accumulation fusion (hfmeg/parallel/wgrad.py) gives the main grads autograd + hooks give.

Each rank builds the same chunk three times and runs the same micro-batches through the
DP wrapper: fused, unfused (`fuse_wgrad=False`: autograd's gradient added by the hook, the
path before fusion) and a float64 truth (float64 model and main grads). Two steps are run
with `zero_grad` between them: a fused main grad written to outside the step's backward, or
not cleared between steps, would miss the truth by about its own size.
"""

from __future__ import annotations

import functools

import pytest
import torch
from bounds import within
from helpers import make_ps
from optim_harness import FP32_EPS, ROUNDING_FACTOR, batch

import hfmeg.parallel.data_parallel as data_parallel
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.parallel.buffers import build_groups
from hfmeg.parallel.data_parallel import DataParallel
from hfmeg.parallel.launch import spawn

GA = 3
# bf16 keeps 8 significant bits: rounding one micro-batch's gradient to bf16 moves it by at most
# 2^-8 of itself (round to nearest: half that, doubled for the fp32 products it came from).
BF16_U = 2.0**-8


def _run(folder, tp, sp, mode, dtype, fuse, grad_dtype=torch.float32):
    """(main grads of this rank's owned shards after step 0 and after step 1 as float64, (bucket launch order,
    whether each backward launched what it should), per-micro-batch increments of step 0 (list over
    micro-batches of lists over buckets), the largest main grad left after a step without backward)."""
    ps = make_ps(tp=tp, sp=sp)
    chunk = load_chunks(HFCheckpoint(folder), ps, dtype=dtype)[0]
    orig = data_parallel.build_groups
    data_parallel.build_groups = functools.partial(build_groups, grad_dtype=grad_dtype)
    try:
        dp = DataParallel([chunk], ps, mode, bucket_size=5000, fuse_wgrad=fuse)
    finally:
        data_parallel.build_groups = orig
    launched, during = [], []
    launch = dp.grad_sync._launch
    dp.grad_sync._launch = lambda b: (launched.append(b.index), launch(b))[1]
    rows = 4 // ps.dp
    steps, increments = [], []
    for step in range(2):
        prev = [b.grad_buf.double().clone() for b in dp.buckets]
        for m in range(GA):
            ids, labels = batch(step, m)
            ids, labels = ids[ps.dp_rank * rows:][:rows], labels[ps.dp_rank * rows:][:rows]
            dp.set_last_microbatch(0, m == GA - 1)
            before = len(launched)
            (chunk(ids, labels=labels).sum() / 100.0).backward()
            # The last backward launches every bucket from the hooks, fused weights' too (wgrad.py: autograd
            # runs their hook with no gradient); none waits for finish_grad_sync.
            during.append(len(launched) - before == (len(dp.buckets) if m == GA - 1 else 0))
            if step == 0 and m < GA - 1:  # before the last micro-batch nothing is reduced yet
                now = [b.grad_buf.double().clone() for b in dp.buckets]
                increments.append([a - p for a, p in zip(now, prev)])
                prev = now
        dp.finish_grad_sync()
        steps.append([dp.owned(b, b.grad_buf).double().clone() for b in dp.buckets])
        dp.zero_grad()
    dp.finish_grad_sync()  # a step without backward: nothing stale may be reduced
    empty = max(b.grad_buf.abs().max().item() for b in dp.buckets)
    return steps, (launched, all(during)), increments, empty


def _dist(a, b):
    """Worst per-bucket ||a - b|| / ||b|| and max|a - b| / max|b|."""
    rel = max(((x - y).norm() / y.norm().clamp_min(1e-30)).item() for x, y in zip(a, b))
    rel_max = max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(a, b))
    return rel, rel_max


def _fp32_rank(folder, tp, sp, mode):
    fused, order_f, _, empty = _run(folder, tp, sp, mode, torch.float32, True)
    plain, order_p, _, _ = _run(folder, tp, sp, mode, torch.float32, False)
    truth, _, _, _ = _run(folder, tp, sp, mode, torch.float64, False, grad_dtype=torch.float64)
    return dict(order=(order_f == order_p, order_f[0], order_f[1]), empty=empty,
                fused=[_dist(f, t) for f, t in zip(fused, truth)],
                plain=[_dist(p, t) for p, t in zip(plain, truth)])


@pytest.mark.parametrize("kind", ["llama3", "gpt2"])
@pytest.mark.parametrize("tp,sp,mode", [(2, True, "overlapped"), (1, False, "overlapped"), (1, False, "ddp")])
def test_fused_main_grads_equal_autograd_within_fp32_rounding(tiny_checkpoints, kind, tp, sp, mode):
    """fp32: over GA micro-batches and two steps, fused main grads stay as close to the float64 truth as the
    unfused path's rounding allows (same terms summed in another order: ROUNDING_FACTOR x its distance + 4 eps),
    and the buckets are reduced in the same order. World 2: TP2 + SP, or DP2."""
    for rank, r in enumerate(spawn(_fp32_rank, 2, tiny_checkpoints[kind], tp, sp, mode)):
        row = (kind, tp, sp, mode, rank, r)
        assert all(r["order"]), row  # the same launch order, buckets launched, each in its backward
        assert r["empty"] == 0.0, row
        for (rel, rel_max), (p_rel, p_max) in zip(r["fused"], r["plain"]):
            within(rel, ROUNDING_FACTOR * p_rel + 4 * FP32_EPS, "fused rel", row)
            within(rel_max, ROUNDING_FACTOR * p_max + 4 * FP32_EPS, "fused rel_max", row)


def _bf16_rank(folder):
    # TP2 + SP, DP 1: the main grads are this rank's own sums, as the increments are.
    fused, _, _, _ = _run(folder, 2, True, "overlapped", torch.bfloat16, True)
    plain, _, increments, _ = _run(folder, 2, True, "overlapped", torch.bfloat16, False)
    out = []
    for b, (f, p) in enumerate(zip(fused[0], plain[0])):
        # The unfused path rounds each micro-batch's gradient to bf16 before adding it (the last micro-batch's
        # increment is the remainder of the sum); the fused one never does. fp32 adds: GA eps of the sum.
        parts = [inc[b] for inc in increments] + [p - sum(inc[b] for inc in increments)]
        bound = BF16_U * sum(x.norm() for x in parts) + GA * FP32_EPS * p.norm()
        out.append(((f - p).norm().item(), bound.item()))
    return out


def test_fused_bf16_main_grads_skip_only_the_bf16_rounding(tiny_checkpoints):
    """bf16 parameters: fused main grads differ from the unfused ones by no more than the bf16 rounding of each
    micro-batch's gradient that the unfused path does and the fused one skips."""
    for rank, rows in enumerate(spawn(_bf16_rank, 2, tiny_checkpoints["llama3"])):
        for diff, bound in rows:
            within(diff, bound, "bf16 fused vs unfused", (rank, diff, bound))


def _traced(folder):
    from hfmeg.parallel.data_parallel import DataParallel as Wrapper

    ps = make_ps()
    chunk = load_chunks(HFCheckpoint(folder), ps)[0]
    Wrapper([chunk], ps, "overlapped", bucket_size=5000)
    x = torch.randn(8, 2, chunk.cfg.hidden_size, requires_grad=True)
    rope = chunk.rope(torch.arange(8).expand(2, 8), torch.float32)
    layer = chunk.layers["0"]
    assert layer.attn.qkv.weight.grad_sink is layer.attn.qkv.weight.main_grad  # fusion is on
    explained = torch._dynamo.explain(layer)(x, rope, None)
    return explained.graph_count, explained.graph_break_count


def test_a_decoder_layer_with_fused_weight_gradients_traces_as_one_graph(tiny_checkpoints):
    """Inside the DP wrapper, with every weight gradient fused, a decoder layer is one graph for torch.compile:
    the main-grad writes are custom ops that declare what they mutate (wgrad.py), nothing dynamo breaks at."""
    assert spawn(_traced, 1, tiny_checkpoints["llama3"]) == [(1, 0)]
