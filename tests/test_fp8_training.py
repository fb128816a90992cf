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
3. One layer at TP2 (column- and row-parallel with and without SP, a replicated linear on this rank's tokens), the
   same values in: the TP layer equals the unsharded `Fp8Gemms` to fp32 rounding for every recipe, which holds only
   if every amax that crosses the split is reduced over the group (a scale from a slice would differ by FP8 steps).
4. Layouts: TP2 with SP, TP2 x PP2 and EP2 (grouped experts) of a tiny Qwen3-MoE in FP8, trained through the
   pipeline and the data-parallel wrapper (weight gradients fused into the fp32 main grads), equal one process
   in FP8 within the same kind of bound; the TP layouts reduce each split operand's amax over the group
   (`quant/fp8_training.py`), without which their scales would differ from one process's.
"""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch

pytest.importorskip("torchao", reason="torchao (the fp8 / dev extra) is not installed")

from torchao.float8 import convert_to_float8_training  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from bounds import within  # noqa: E402
from helpers import gather_tp, make_ps, next_token_labels, train_step_as_one  # noqa: E402
from hfmeg.checkpoint.hf_reader import HFCheckpoint  # noqa: E402
from hfmeg.checkpoint.load import load_chunks  # noqa: E402
from hfmeg.checkpoint.rules import chunk_rules, to_hf  # noqa: E402
from hfmeg.models.fp8 import convert_fp8  # noqa: E402
from hfmeg.models.generate import full_logits  # noqa: E402
from hfmeg.parallel.launch import spawn  # noqa: E402
from hfmeg.parallel.layers import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear  # noqa: E402
from hfmeg.parallel.comm import gather_tokens, split_tokens  # noqa: E402
from hfmeg.parallel.roles import ParamRole  # noqa: E402
from hfmeg.parallel.stored_names import stored_tensors  # noqa: E402
from hfmeg.parallel.wgrad import linear  # noqa: E402
from hfmeg.quant.fp8_training import Fp8Gemms, float8_config  # noqa: E402
from hfmeg.train.config import FP8Recipe  # noqa: E402
from tiny_models import reference_attention, save_tiny  # noqa: E402

FP32_EPS = torch.finfo(torch.float32).eps
IDS = torch.tensor([[3, 17, 42, 7, 99, 150, 12, 5, 61, 200, 33, 8, 90, 14, 71, 2],
                    [44, 9, 130, 27, 6, 81, 210, 19, 55, 4, 160, 38, 11, 97, 23, 66]])


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


def _tp_layers(recipe):
    """Per layer kind and SP: the worst |TP2 - unsharded| / bound over output, grad input and grad weight."""
    torch.manual_seed(0)
    s, b, h, f = 16, 2, 64, 96
    x, g_col, g_row = torch.randn(s, b, h), torch.randn(s, b, f), torch.randn(s, b, h)
    w_col, w_row = torch.randn(f, h) * 0.1, torch.randn(h, f) * 0.1
    # Rank 1's half of every split dim: one operand of each GEMM that reduces over it 2^-16 times smaller, the other
    # 2^16 times larger (their products as large as the other half's). A scale taken from a slice then keeps both
    # halves, a scale over the whole tensor (or row) flushes the small half to zero; the powers of two matter:
    # rowwise scales are powers of two, which move an FP8 value only where it leaves e4m3's range.
    tiny, big = 2.0**-16, 2.0**16
    x[s // 2:] *= tiny  # tokens: a replicated linear's grad weight reduces over them
    g_col[s // 2:] *= big
    g_col[..., f // 2:] *= tiny  # a column-parallel grad input reduces over the output features
    w_col[f // 2:] *= big
    w_row[:, f // 2:] *= big  # a row-parallel output reduces over the input features
    config = float8_config(recipe, emulate=True)
    worst = {}
    for kind, sp in (("column", False), ("column", True), ("row", False), ("row", True), ("replicated", False)):
        ps = make_ps(tp=2, sp=sp)
        w, g = (w_col, g_col) if kind == "column" else (w_row, g_row) if kind == "row" else (w_col, g_col)
        full_x = x
        if kind == "row":
            full_x = torch.randn(s, b, f, generator=torch.Generator().manual_seed(1))
            full_x[..., f // 2:] *= tiny
        # the unsharded reference: the same recipe, nothing split
        xr = full_x.clone().requires_grad_()
        wr = torch.nn.Parameter(w.clone())
        linear(xr, wr, fp8=Fp8Gemms(config)).backward(g)
        r = ps.tp_rank
        if kind == "column":
            layer = ColumnParallelLinear(h, f, ps, bias=False)
            local_w, xin = w.chunk(2, 0)[r], (full_x.chunk(2, 0)[r] if sp else full_x)
        elif kind == "row":
            layer = RowParallelLinear(f, h, ps, bias=False)
            local_w, xin = w.chunk(2, 1)[r], full_x.chunk(2, -1)[r]
        else:
            layer = ReplicatedLinear(h, f, ParamRole("weight", sequence_parallel=True))
            local_w, xin = w, full_x
        convert = {"column": Fp8Gemms(config, ps.tp_group, weight_split=0, grad_split=1),
                   "row": Fp8Gemms(config, ps.tp_group, input_split=1, weight_split=1),
                   "replicated": Fp8Gemms(config, ps.tp_group, input_split=0, grad_split=0)}
        layer.fp8 = convert[kind]
        with torch.no_grad():
            layer.weight.copy_(local_w)
        xin = xin.clone().requires_grad_()
        if kind == "replicated":  # a rank's block of the tokens, as the MoE experts see them
            y = gather_tokens(layer(split_tokens(xin.reshape(s * b, h), ps)), ps, s * b).view(s, b, f)
        else:
            y = layer(xin)
        gout = g.chunk(2, -1)[r] if kind == "column" else (g.chunk(2, 0)[r] if sp else g)
        y.backward(gout)
        if kind == "column":
            pieces = [(torch.cat(gather_tp(y.detach(), ps), -1), linear(full_x, wr, fp8=Fp8Gemms(config)).detach()),
                      (layer.weight.grad, wr.grad.chunk(2, 0)[r])]
            dx = torch.cat(gather_tp(xin.grad, ps), 0) if sp else xin.grad
            pieces.append((dx, xr.grad))
        elif kind == "row":
            y_full = torch.cat(gather_tp(y.detach(), ps), 0) if sp else y.detach()
            pieces = [(y_full, linear(full_x, wr, fp8=Fp8Gemms(config)).detach()),
                      (layer.weight.grad, wr.grad.chunk(2, 1)[r]), (xin.grad, xr.grad.chunk(2, -1)[r])]
        else:
            torch.distributed.all_reduce(layer.weight.grad, group=ps.tp_group)  # partial per rank's tokens
            pieces = [(y.detach(), linear(full_x, wr, fp8=Fp8Gemms(config)).detach()),
                      (layer.weight.grad, wr.grad), (xin.grad, xr.grad)]
        # fp32 sums of at most max(h, f, s*b) products of the same dequantized values, in another order
        terms = max(h, f, s * b) * FP32_EPS
        worst[(kind, sp)] = max(((a - e).abs().max() / (terms * e.abs().max())).item() for a, e in pieces)
    return worst


@pytest.mark.parametrize("recipe", get_args(FP8Recipe)[1:])
def test_tp_layers_equal_unsharded(recipe):
    for rank_worst in spawn(_tp_layers, 2, recipe):
        for (kind, sp), ratio in rank_worst.items():
            within(ratio, 4.0, f"fp8 {recipe} TP2 {kind} sp={sp} / fp32 rounding bound")


def _fp8_vs_torchao(folder, recipe):
    """(hfmeg FP8, torchao FP8, fp32) logits, loss and HF-named gradients, one process."""
    labels = next_token_labels(IDS)

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
    labels = next_token_labels(IDS)
    chunks = load_chunks(HFCheckpoint(folder), ps)
    if recipe != "off":
        convert_fp8(chunks, recipe, [], ps)
    logits = full_logits(chunks, ps, IDS)
    loss, wrapper = train_step_as_one(chunks, ps, IDS, labels)
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



def test_planner_counts_fp8_copies_and_gemm_rate():
    """`hfmeg plan --fp8` / `model.fp8` with `layout: auto`: the largest linear's FP8 operand copies in the transient
    memory (saved activations unchanged), and the linears' GEMMs at the profile's FP8 rate plus their casts."""
    from hfmeg.families import model_config_from_hf
    from hfmeg.plan.fp8 import fp8_cast_bytes, fp8_copy_bytes
    from hfmeg.plan.hardware import ClusterSpec, gpu_spec
    from hfmeg.plan.layout import PlanLayout
    from hfmeg.plan.memory import plan_shape, stage_memory
    from hfmeg.plan.profile import ASSUMED
    from hfmeg.plan.search import Job, evaluate
    from tiny_models import tiny_config

    cfg = model_config_from_hf(tiny_config("llama3", hidden_size=4096, intermediate_size=11008, num_hidden_layers=4,
                                           num_attention_heads=32, num_key_value_heads=8, vocab_size=32000))
    lay = PlanLayout(2, 2, 2, 1)
    cluster = ClusterSpec(gpu_spec("h100"), 8, 8)
    plain, fp8 = (evaluate(Job(cfg, cluster, ASSUMED["h100"], 32, 4096, fp8=f), lay) for f in (False, True))
    shape = plan_shape(lay, 4096, 2)
    tok = 4096
    # the largest linear at TP2 is the gate/up projection: 4096 in, 2 x 11008 / 2 out
    assert fp8_copy_bytes(cfg, shape) == tok * 4096 + 4096 * 11008 + 2 * tok * 11008
    # the first stage (no LM head, whose loss buffers would be the larger transient) holds them beside a layer's
    first = [stage_memory(cfg, lay, 0, 32, 4096, fp8=f) for f in (False, True)]
    assert first[1].transient - first[0].transient == fp8_copy_bytes(cfg, shape)
    assert first[1].activations == first[0].activations  # saved for backward in the model dtype, as before
    assert fp8.time.step_s < plain.time.step_s  # FP8 GEMMs at twice the rate outweigh the casts at 7B shapes
    assert fp8_cast_bytes(2, 3, 4, 2) == 5 * (6 + 12)


def test_a_training_run_in_fp8_says_what_it_converted_and_exports_the_master_dtype(tmp_path, capsys):
    """The trainer with `model.fp8` on stories260K (its FFN of 172 is not a multiple of 16: the MLP stays in fp32):
    the start-up lines, a finite loss, and an export in the master dtype whose card names the recipe."""
    from safetensors import safe_open

    from helpers import stories_or_skip
    from hfmeg.data import DataConfig, SourceConfig
    from hfmeg.optim.config import OptimizerConfig
    from hfmeg.train.config import CheckpointArgs, LoopArgs, ModelArgs, TrainConfig
    from hfmeg.train.metrics import read_metrics
    from hfmeg.train.trainer import Trainer
    from tiny_models import ASSETS

    model, data = stories_or_skip(), ASSETS / "data" / "alpaca_en_demo.json"
    cfg = TrainConfig(model=ModelArgs(path=str(model), dtype="fp32", fp8="tensorwise"),
                      optim=OptimizerConfig(lr=1e-3), data=DataConfig(sources=[SourceConfig(str(data))], seq_len=64),
                      train=LoopArgs(micro_batch_size=1, global_batch_size=2, max_steps=3),
                      checkpoint=CheckpointArgs(out=str(tmp_path / "run")), report_to=[])
    hf = Trainer(cfg).run().hf_folder
    out = capsys.readouterr().out
    assert "fp8 tensorwise: 10 linears of rank 0 in FP8, emulated on cpu" in out, out
    assert "a dim not a multiple of 16: layers.0.mlp.fc1 344x64" in out, out
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    with safe_open(hf / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}
    assert "FP8 compute: torchao's `tensorwise` recipe" in (hf / "README.md").read_text()
