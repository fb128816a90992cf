"""tools/bench_mfu.py at tiny size on the CPU: output contract and a real parity check.

Both sides start from the same random transformers weights and see the same token
ids; in fp32 the hfmeg path (forward_backward + overlapped DistributedOptimizer with
fused AdamW, clipping, weight-decay exclusions) and the transformers anchor (its own
loss, torch fused AdamW) must report the same loss at every step, including the
steps after optimizer updates, for the LLaMA and for the Mixtral (`--experts`). No timing
is asserted.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import LlamaConfig, MixtralConfig

from hfmeg.families import model_config_from_hf
from hfmeg.plan.flops import training_flops
from hfmeg.plan.profile import load_profile
import forkrun
from tool_loader import load_tool

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_mfu.py"
RECORDS = Path(__file__).resolve().parents[1] / "docs" / "measurements"
KEYS = {"device": str, "hfmeg_tokens_per_s": float, "hf_tokens_per_s": float, "speedup": float,
        "hfmeg_tokens": int, "hf_tokens": int, "hfmeg_losses": list, "hf_losses": list, "shapes": dict}


def _tool():
    return load_tool("bench_mfu")


def test_tiny_run_reports_both_sides_with_equal_losses():
    peak_tflops = 0.5
    out = forkrun.run([sys.executable, str(TOOL), "--tiny", "--peak-tflops", str(peak_tflops)],
                      timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    r = json.loads(lines[-1])
    assert any(line.startswith("hfmeg") for line in lines[:-1]) and any(line.startswith("hf ") for line in lines)
    for key, typ in KEYS.items():
        assert isinstance(r[key], typ), (key, r[key])
    assert r["device"] == "cpu" and r["dtype"] == "float32"
    assert r["hfmeg_peak_mem_bytes"] is None and r["hf_peak_mem_bytes"] is None  # CUDA-only measurement

    sh = r["shapes"]
    steps = sh["warmup"] + sh["steps"]
    assert r["hfmeg_tokens"] == r["hf_tokens"] == steps * sh["grad_accum"] * sh["micro_batch_size"] * sh["seq"]
    assert len(r["hfmeg_losses"]) == len(r["hf_losses"]) == steps
    for ours, theirs in zip(r["hfmeg_losses"], r["hf_losses"]):
        assert math.isfinite(ours) and abs(ours - theirs) <= 2e-5 * abs(theirs), (r["hfmeg_losses"], r["hf_losses"])
    assert abs(r["hf_losses"][0] - math.log(sh["vocab"])) < 1.0  # random init: near-uniform predictions

    assert r["speedup"] == pytest.approx(r["hfmeg_tokens_per_s"] / r["hf_tokens_per_s"])
    assert r["peak_flops"] == peak_tflops * 1e12
    # MFU = tokens/s x Megatron-LM FLOPs per token / peak, for the bench's own shapes.
    cfg = model_config_from_hf(LlamaConfig(
        hidden_size=sh["hidden"], intermediate_size=sh["ffn"], num_hidden_layers=sh["layers"],
        num_attention_heads=sh["heads"], vocab_size=sh["vocab"]))
    per_token = training_flops(cfg, 1, sh["seq"]) / sh["seq"]
    assert r["flops_per_token"] == per_token
    for side in ("hfmeg", "hf"):
        assert r[f"{side}_mfu"] == pytest.approx(r[f"{side}_tokens_per_s"] * per_token / (peak_tflops * 1e12))


def test_tiny_moe_run_counts_the_active_experts_and_the_planner_predicts_it():
    out = forkrun.run([sys.executable, str(TOOL), "--tiny", "--experts", "4", "--top-k", "2", "--peak-tflops",
                       "0.5"], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    sh = r["shapes"]
    assert sh["experts"] == 4 and sh["top_k"] == 2
    assert r["hfmeg_tokens_per_s"] > 0 and r["hf_tokens_per_s"] > 0 and r["hfmeg_mfu"] > 0 and r["hf_mfu"] > 0
    for ours, theirs in zip(r["hfmeg_losses"], r["hf_losses"], strict=True):
        assert math.isfinite(ours) and abs(ours - theirs) <= 2e-5 * abs(theirs), (r["hfmeg_losses"], r["hf_losses"])
    # By hand, per token: 6 x (matmul parameters it goes through + LM head) + attention's 12 s l h. A layer's are
    # Q, K, V, O (4 h^2, as many K/V heads as query heads), the router (h E) and 2 of the 4 SwiGLU experts (3 h f).
    h, f, s, n = sh["hidden"], sh["ffn"], sh["seq"], sh["layers"]
    layer = 4 * h * h + h * 4 + 2 * 3 * h * f
    assert r["flops_per_token"] == 6 * (n * layer + h * sh["vocab"]) + 12 * s * n * h

    # check_plan_gpu rebuilds the row's Mixtral (a dense row's LLaMA) and the planner predicts it at EP = 1.
    plan = load_tool("check_plan_gpu")
    hf = plan.hf_config(sh)
    assert isinstance(hf, MixtralConfig) and not hf.output_router_logits
    assert (hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size) == (4, 2, sh["ffn"])
    assert type(plan.hf_config({**sh, "experts": None, "top_k": None})) is LlamaConfig
    measured = {**r, "hfmeg_peak_mem_bytes": 2**20}  # a CPU run measures no GPU memory
    row = plan.check(measured, "h100", load_profile(RECORDS / "h100_profile.json"))
    assert (row["experts"], row["top_k"], row["layout"]) == (4, 2, "tp1-pp1-dp1-mb2-none-overlapped")
    assert row["predicted_bytes"] > 0 and row["predicted_step_s"] > 0


def test_a_family_at_the_bench_shapes_has_transformers_losses():
    """`--family`: transformers' default config of that model_type at the bench's shapes and `--set` fields (Gemma 2:
    soft-capped scores, so the anchor attends eagerly; a window shorter than the rows), fp32 losses equal step by
    step as for the LLaMA."""
    out = forkrun.run([sys.executable, str(TOOL), "--tiny", "--family", "gemma2", "--set", "head_dim=16",
                       "--set", "sliding_window=8"], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["shapes"]["family"] == "gemma2" and r["shapes"]["overrides"] == {"head_dim": 16, "sliding_window": 8}
    assert r["hf_settings"].startswith("eager,")
    hf = _tool().hf_config(r["shapes"])
    assert (hf.model_type, hf.head_dim, hf.sliding_window, hf.hidden_size) == ("gemma2", 16, 8, r["shapes"]["hidden"])
    assert hf.sliding_window < r["shapes"]["seq"] and hf.attn_logit_softcapping
    for ours, theirs in zip(r["hfmeg_losses"], r["hf_losses"], strict=True):
        assert math.isfinite(ours) and abs(ours - theirs) <= 2e-5 * abs(theirs), (r["hfmeg_losses"], r["hf_losses"])


def test_bad_arguments_exit_2_with_one_message(capsys):
    tool = _tool()
    for argv, field in ((["--tiny", "--heads", "5"], "--heads"), (["--tiny", "--seq", "0"], "--seq"),
                        (["--tiny", "--warmup", "-1"], "--warmup"), (["--tiny", "--top-k", "2"], "--top-k"),
                        (["--tiny", "--experts", "2", "--top-k", "3"], "--top-k"),
                        (["--tiny", "--family", "gpt_oss", "--experts", "4"], "--experts"),
                        (["--tiny", "--set", "head_dim=16"], "--set"),
                        (["--tiny", "--family", "gemma2", "--set", "head_dim"], "--set")):
        with pytest.raises(SystemExit) as e:
            tool.parse_args(argv)
        assert e.value.code == 2
        assert field in capsys.readouterr().err.strip().splitlines()[-1]


def test_trainer_path_runs_packed_rows_and_defaults_to_tiny_without_a_gpu():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # a machine without a GPU, also when the tests have one
    out = forkrun.run([sys.executable, str(TOOL), "--trainer-path"], timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "no GPU, running the tiny smoke shapes" in out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    for key, typ in KEYS.items():
        assert isinstance(r[key], typ), (key, r[key])
    assert r["trainer_path"] is True and r["shapes"]["hidden"] == 64
    assert r["documents_per_row"] > 2  # packed: several documents per row
    assert all(math.isfinite(x) for x in r["hfmeg_losses"] + r["hf_losses"])


def test_default_shapes_follow_the_device():
    tool = _tool()
    assert tool.parse_args([], cuda=True).hidden == 4096
    assert tool.parse_args(["--experts", "8"], cuda=True).top_k == 2
    a = tool.parse_args([], cuda=False)
    assert a.tiny and a.hidden == 64


def test_packed_microbatches_are_the_recipes_rows():
    tool = _tool()
    a = tool.parse_args(["--tiny", "--seq", "256", "--micro-batch-size", "3"], cuda=False)
    mb = tool.packed_microbatches(a, np.random.default_rng(0))
    assert [tuple(t.shape) for t in (mb.input_ids, mb.labels, mb.position_ids, mb.segment_ids)] == [(3, 256)] * 4
    seg, labels = mb.segment_ids, mb.labels
    for row, lab in zip(seg, labels):
        docs = set(row.tolist()) - {0}
        assert 5 <= len(docs) <= 40  # ~14 documents per row
        assert (lab[row == 0] == -100).all()  # padding carries no loss
        for d in docs:  # prompts are masked: each document has fewer targets than tokens
            assert 0 < int((lab[row == d] != -100).sum()) < int((row == d).sum())


def test_tiny_fp8_side_trains_the_same_tokens_within_fp8_rounding():
    """`--fp8 RECIPE`: a third side, hfmeg with its linears in FP8 (emulated on the CPU), from the same weights and
    batches: its first loss (before any update) is hfmeg's up to FP8 rounding (e4m3: 3 mantissa bits, a relative step
    of at most 2^-3 per operand, far less on a mean over tokens), and not equal to it (the GEMMs did run in FP8)."""
    out = forkrun.run([sys.executable, str(TOOL), "--tiny", "--fp8", "rowwise"], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["fp8"] == "rowwise" and "fp8 rowwise:" in out.stderr and "emulated on cpu" in out.stderr
    assert r["fp8_speedup"] == pytest.approx(r["hfmeg_fp8_tokens_per_s"] / r["hfmeg_tokens_per_s"])
    first, plain = r["hfmeg_fp8_losses"][0], r["hfmeg_losses"][0]
    assert first != plain and first == pytest.approx(plain, rel=2**-3)
    assert r["fp8_loss_gap"] == max(abs(a - b) for a, b in zip(r["hfmeg_fp8_losses"], r["hfmeg_losses"]))
