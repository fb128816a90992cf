"""FP8 training compute (`model.fp8`, docs/fp8.md), emulated on CPU, against torchao and across layouts.

1. One linear, the same values in: hfmeg's `Fp8Gemms` (forward, grad input, and the grad weight fused into a main
   grad) equals torchao's own `Float8Linear` (`convert_to_float8_training`) for every recipe, to fp32 rounding:
   both cast the same values with the same scales, so only the order of the fp32 sums may differ.
2. A whole model, one process: hfmeg's FP8 logits, loss and every gradient equal transformers' model swapped to
   FP8 by torchao's `convert_to_float8_training` (LM head kept out, as hfmeg keeps it) with the same recipe, for
   tensorwise and rowwise. The family is Phi-3, whose checkpoint fuses QKV and gate/up as hfmeg does, so each
   scale covers the same tensor (a row permutation changes no amax). The two runs quantize values that differ
   only by fp32 rounding, so they can differ where a value lies on an FP8 rounding boundary: a flip moves one
   product by one FP8 step. The bound is the FP8 rounding's whole effect on that quantity (FP8 against fp32, the
   same model and recipe), which moves every product by up to half a step: far more than a few flips.
3. Layouts: TP2 with SP, TP2 x PP2 and EP2 (grouped experts) of a tiny Qwen3-MoE in FP8, trained through the
   pipeline and the data-parallel wrapper (weight gradients fused into the fp32 main grads), equal one process
   in FP8 within the same kind of bound; the TP layouts reduce each split operand's amax over the group
   (`quant/fp8_training.py`), without which their scales would differ from one process's.
"""

from __future__ import annotations

from typing import get_args

import pytest
import torch

pytest.importorskip("torchao", reason="torchao (the fp8 / dev extra) is not installed")

from torchao.float8 import convert_to_float8_training  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from bounds import within  # noqa: E402
from helpers import gather_tp, make_ps  # noqa: E402
from hfmeg.checkpoint.hf_reader import HFCheckpoint  # noqa: E402
from hfmeg.checkpoint.load import load_chunks  # noqa: E402
from hfmeg.checkpoint.rules import chunk_rules, to_hf  # noqa: E402
from hfmeg.data.microbatch import MicroBatch  # noqa: E402
from hfmeg.models.fp8 import convert_fp8  # noqa: E402
from hfmeg.models.generate import full_logits  # noqa: E402
from hfmeg.parallel.data_parallel import DataParallel  # noqa: E402
from hfmeg.parallel.launch import spawn  # noqa: E402
from hfmeg.parallel.pipeline import forward_backward  # noqa: E402
from hfmeg.parallel.stored_names import stored_tensors  # noqa: E402
from hfmeg.parallel.wgrad import linear  # noqa: E402
from hfmeg.quant.fp8_training import Fp8Gemms, float8_config  # noqa: E402
from hfmeg.train.config import FP8Recipe  # noqa: E402
from tiny_models import reference_attention, save_tiny  # noqa: E402

FP32_EPS = torch.finfo(torch.float32).eps
IDS = torch.tensor([[3, 17, 42, 7, 99, 150, 12, 5, 61, 200, 33, 8, 90, 14, 71, 2],
                    [44, 9, 130, 27, 6, 81, 210, 19, 55, 4, 160, 38, 11, 97, 23, 66]])


def _labels(ids):
    return torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], dim=1)


@pytest.mark.parametrize("recipe", get_args(FP8Recipe)[1:])
def test_linear_equals_torchao(recipe):
    torch.manual_seed(0)
    x = torch.randn(2, 24, 64)
    w = torch.randn(48, 64) * 0.1
    g = torch.randn(2, 24, 48)
    config = float8_config(recipe, emulate=True)

    ref = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False))
    with torch.no_grad():
        ref[0].weight.copy_(w)
    convert_to_float8_training(ref, config=config)
    xr = x.clone().requires_grad_()
    ref(xr).backward(g)

    weight = torch.nn.Parameter(w.clone())
    weight.grad_sink = torch.zeros_like(w)  # the fused path: the gradient lands in the fp32 main grad
    xh = x.clone().requires_grad_()
    y = linear(xh, weight, fp8=Fp8Gemms(config))
    y.backward(g)
    assert weight.grad is None

    with torch.no_grad():
        yr = ref(x)
    # Each output is a sum of 64 (forward, grad weight over 48 rows: 48) products of the same dequantized values.
    terms = 64 * FP32_EPS
    for got, want, what in ((y, yr, "output"), (xh.grad, xr.grad, "grad input"),
                            (weight.grad_sink, ref[0].weight.grad, "grad weight")):
        scale = want.abs().max().item()
        within((got - want).abs().max().item(), terms * scale * 4, f"fp8 {recipe} linear {what} vs torchao")
    plain = torch.nn.functional.linear(x, w)
    assert (y.detach() - plain).abs().max() > 1e3 * terms * plain.abs().max(), "FP8 rounding did not happen"


def _fp8_vs_torchao(folder, recipe):
    """(hfmeg FP8, torchao FP8, fp32) logits, loss and HF-named gradients, one process."""
    labels = _labels(IDS)

    def transformers_run(fp8: bool):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                     attn_implementation=reference_attention(folder))
        if fp8:
            convert_to_float8_training(model, config=float8_config(recipe, emulate=True),
                                       module_filter_fn=lambda mod, fqn: fqn != "lm_head")
        out = model(IDS, labels=IDS)
        out.loss.backward()
        return out.logits.detach(), out.loss.item(), {n: p.grad for n, p in model.named_parameters()}

    ps = make_ps()
    chunk = load_chunks(HFCheckpoint(folder), ps)[0]
    lines = convert_fp8([chunk], recipe, [], ps)
    logits = chunk(IDS)[..., : chunk.cfg.vocab_size]
    per_token = chunk(IDS, labels=labels)
    loss = per_token.sum() / (labels != -100).sum()
    loss.backward()
    params = dict(chunk.named_parameters())
    grads = {}
    for rule in chunk_rules(chunk.cfg, chunk.layer_ids, True, True):
        grads.update(to_hf(rule, [params[rule.local].grad], chunk.cfg))
    return (logits.detach(), loss.item(), grads), transformers_run(True), transformers_run(False), lines


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_model_equals_torchao(recipe, tmp_path):
    folder = save_tiny("phi3", tmp_path / "phi3")
    ours, theirs, exact, lines = _fp8_vs_torchao(folder, recipe)
    assert lines[0].startswith(f"fp8 {recipe}: 8 linears of rank 0 in FP8, emulated on cpu"), lines
    assert "layers.0.attn.qkv" in lines[1] and "excluded by *.router: none" in lines[2], lines
    (lo, lso, go), (lt, lst, gt), (le, lse, ge) = ours, theirs, exact
    within((lo - lt).abs().max().item(), (lt - le).abs().max().item(), f"fp8 {recipe} logits vs torchao")
    within(abs(lso - lst), abs(lst - lse), f"fp8 {recipe} loss vs torchao")
    for name, want in gt.items():
        name_ours = name if name in go else name.removeprefix("model.")
        rounding = (want - ge[name]).abs().max().item()
        within((go[name_ours] - want).abs().max().item(), max(rounding, 64 * FP32_EPS * want.abs().max().item()),
               f"fp8 {recipe} grad {name} vs torchao")


# (tp, pp, sp, ep); one 4-process world runs them all (the rest of the world as DP copies of the same rows).
LAYOUTS = [(2, 1, True, 1), (2, 2, False, 1), (1, 1, False, 2)]
MOE = dict(intermediate_size=64)  # the dense layer's TP2 shards stay multiples of 16, as FP8 GEMMs need


def _run(folder, recipe, ps):
    """logits (rank 0 of the last stage, else None), loss and this rank's {HF name: main grad} at `ps`, with the
    FP8 `recipe` (`off`: in fp32)."""
    labels = _labels(IDS)
    chunks = load_chunks(HFCheckpoint(folder), ps)
    if recipe != "off":
        convert_fp8(chunks, recipe, [], ps)
    logits = full_logits(chunks, ps, IDS)
    wrapper = DataParallel(chunks, ps, "ddp", bucket_size=2**20)
    loss = forward_backward(chunks, ps, [MicroBatch(input_ids=IDS, labels=labels)], schedule="1f1b",
                            num_tokens=int((labels != -100).sum()) * ps.dp, grad_sync=wrapper)
    loss = loss * ps.dp if loss is not None else None
    wrapper.finish_grad_sync()
    grads = {}
    for chunk in chunks:
        local = stored_tensors(chunk, lambda p: p.main_grad)
        for rule in chunk_rules(chunk.cfg, chunk.layer_ids, chunk.pre_process, chunk.post_process, chunk.experts):
            grads.update(to_hf(rule, gather_tp(local[rule.local], ps), chunk.cfg))
    grads = {n: g.clone() for n, g in grads.items()}
    wrapper.grad_sync.remove_hooks()
    return logits, loss, grads


def _layouts(folder, recipe):
    rows = []
    for tp, pp, sp, ep in LAYOUTS:
        ps = make_ps(tp=tp, pp=pp, sp=sp, ep=ep)
        logits, loss, grads = _run(folder, recipe, ps)
        gathered = [None] * ps.world_size
        torch.distributed.all_gather_object(gathered, (logits, loss, grads))
        if ps.rank == 0:
            merged = {}
            for _, _, g in gathered:
                merged.update(g)
            first = next(r for r in gathered if r[0] is not None)
            rows.append(dict(layout=(tp, pp, sp, ep), logits=first[0], loss=next(r[1] for r in gathered
                                                                                 if r[1] is not None), grads=merged))
    return rows


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_layouts_equal_one_process(recipe, tmp_path):
    folder = save_tiny("qwen3_moe", tmp_path / "moe", **MOE)
    one = _run(folder, recipe, make_ps())
    exact = _run(folder, "off", make_ps())
    rows = spawn(_layouts, 4, folder, recipe)[0]
    assert [r["layout"] for r in rows] == LAYOUTS
    (l1, loss1, g1), (le, losse, ge) = one, exact
    for row in rows:
        what = f"fp8 {recipe} {row['layout']}"
        within((row["logits"] - l1).abs().max().item(), (l1 - le).abs().max().item(), f"{what} logits")
        within(abs(row["loss"] - loss1), abs(loss1 - losse), f"{what} loss")
        assert row["grads"].keys() == g1.keys()
        for name, want in g1.items():
            rounding = (want - ge[name]).abs().max().item()
            within((row["grads"][name] - want).abs().max().item(),
                   max(rounding, 64 * FP32_EPS * want.abs().max().item()), f"{what} grad {name}")

