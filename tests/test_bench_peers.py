"""tools/bench_peers.py at tiny size on the CPU: every row and the summary as JSON, one skip line per peer that
cannot run here (torchtitan and Megatron-Core are not hfmeg dependencies), and the FLOP count by hand. No timing
is asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

import forkrun
from tool_loader import load_tool

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_peers.py"
PEERS = {"torchtitan": "torchtitan", "megatron-core": "megatron"}
ROW = {"system": str, "precision": str, "settings": str}
RAN = {"repeats": int, "tokens_per_s": float, "tokens_per_s_min": float, "tokens_per_s_max": float,
       "tokens_per_s_all": list, "first_loss": float}


def test_tiny_cpu_run_reports_every_row_and_skips_each_absent_peer_once():
    peak_tflops = 0.5
    # transformers-compiled is left out: Inductor's C++ compile of it takes longer on a CPU than the rest together.
    systems = ["hfmeg", "transformers", "torchtitan", "megatron-core"]
    out = forkrun.run([sys.executable, str(TOOL), "--tiny", "--repeats", "3", "--peak-tflops", str(peak_tflops),
                       "--systems", ",".join(systems)], timeout=300,
                      env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    *rows, summary = records
    assert [r["system"] for r in rows] == systems and summary["summary"] is True

    skip_lines = [line for line in out.stderr.splitlines() if line.startswith("skip ")]
    for row in rows:
        for key, typ in ROW.items():
            assert isinstance(row[key], typ), (key, row)
        name = row["system"]
        mine = [line for line in skip_lines if line.startswith(f"skip {name}: ")]
        if row["skipped"]:
            assert mine == [f"skip {name}: {row['skipped']}"], skip_lines
            if importlib.util.find_spec(PEERS[name]) is None:
                assert row["skipped"].startswith("not installed"), row
            continue
        assert not mine, skip_lines
        for key, typ in RAN.items():
            assert isinstance(row[key], typ), (key, row)
        assert row["repeats"] == len(row["tokens_per_s_all"]) == 3
        assert row["tokens_per_s_min"] <= row["tokens_per_s"] <= row["tokens_per_s_max"]
        assert row["peak_mem_bytes"] is None  # CUDA-only measurement
        assert row["mfu"] == pytest.approx(row["tokens_per_s"] * summary["flops_per_token"] / (peak_tflops * 1e12))
        assert summary["ratio_vs_hfmeg"][name] == pytest.approx(row["tokens_per_s"] / rows[0]["tokens_per_s"])
    assert len(skip_lines) == sum(bool(r["skipped"]) for r in rows)
    assert not rows[0]["skipped"] and not rows[1]["skipped"]  # hfmeg and transformers always run
    assert rows[3]["skipped"]  # Megatron-Core is CUDA only
    assert "fp32 master" in rows[0]["precision"] and "no fp32 master" in rows[1]["precision"]

    # The FLOPs per token, by hand for the tiny LLaMA: 6 x (Q, K, V, O = 4 h^2 and SwiGLU's 3 h f per layer, plus the
    # LM head h V) + 12 s l h for attention over the full s x s scores.
    sh = summary["shapes"]
    h, f, s, n, v = sh["hidden"], sh["ffn"], sh["seq"], sh["layers"], sh["vocab"]
    assert summary["flops_per_token"] == 6 * (n * (4 * h * h + 3 * h * f) + h * v) + 12 * s * n * h
    assert summary["tokens_per_step"] == sh["grad_accum"] * sh["micro_batch_size"] * s
    assert "full s x s" in summary["flop_convention"]


def test_bad_arguments_exit_2_with_one_message(capsys):
    tool = load_tool("bench_peers")
    for argv, field in ((["--systems", "hfmeg,deepspeed"], "--systems"), (["--repeats", "0"], "--repeats"),
                        (["--systems", ","], "--systems")):
        with pytest.raises(SystemExit) as e:
            tool.parse_args(["--tiny", *argv], cuda=False)
        assert e.value.code == 2
        assert field in capsys.readouterr().err.strip().splitlines()[-1]


def test_default_shapes_follow_the_device():
    tool = load_tool("bench_peers")
    gpu = tool.parse_args([], cuda=True)
    assert (gpu.hidden, gpu.layers, gpu.seq, gpu.repeats) == (4096, 4, 4096, 3)
    assert gpu.systems == tool.NAMES
    assert tool.parse_args([], cuda=False).hidden == 64
