"""tools/bench_peft.py at tiny size on gloo: the output contract and the byte counts it must give, for
hfmeg's full, LoRA and QLoRA modes and the peft + transformers anchor (timings are reported, never asserted)."""

from __future__ import annotations
import forkrun

import json
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def test_bench_peft_reports_both_modes():
    out = forkrun.run([sys.executable, str(TOOLS / "bench_peft.py"), "--world", "2", "--tp", "2", "--hidden", "128",
                          "--layers", "2", "--seq", "16", "--vocab", "256", "--r", "4", "--steps", "1"], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    full, lora, anchor = r["by_mode"]["full"], r["by_mode"]["lora"], r["by_mode"]["peft"]
    # Per TP rank, r = 4, h = 128 (2 heads, 2 KV heads, 64 wide), ffn 320, 2 layers; column bases: A whole,
    # B halved; row bases: A halved, B whole.
    h, f, q = 128, 320, 128
    per_layer = 4 * ((h + q // 2) + 2 * (h + q // 2) + (q // 2 + h) + 2 * (h + f // 2) + (f // 2 + h))
    assert lora["trainable_params"] == 2 * per_layer
    for row in (full, lora):  # fp32 master + two moments, one DP rank: 12 bytes per trainable element
        assert row["opt_state_bytes"] == 12 * row["trainable_params"]
        assert row["tokens_per_s"] > 0 and row["peak_bytes"] > 0
    assert full["trainable_params"] * 2 >= r["params"]  # full: every weight (TP halves most of them)
    assert r["lora_vs_full_tokens_per_s"] == lora["tokens_per_s"] / full["tokens_per_s"]
    # The peft anchor: the same adapters unsplit (one process), torch AdamW's two moments (no fp32 master).
    full_per_layer = 4 * ((h + q) + 2 * (h + q) + (q + h) + 2 * (h + f) + (f + h))
    assert anchor["trainable_params"] == 2 * full_per_layer and anchor["opt_state_bytes"] == 8 * 2 * full_per_layer
    assert anchor["tokens_per_s"] > 0 and anchor["peak_bytes"] > 0
    assert r["lora_vs_peft_tokens_per_s"] == lora["tokens_per_s"] / anchor["tokens_per_s"]
    assert r["lora_vs_peft_peak"] == lora["peak_bytes"] / anchor["peak_bytes"]


def test_bench_peft_qlora_mode_holds_the_4bit_base():
    pytest.importorskip("bitsandbytes")
    """`--modes lora,qlora`: the same adapters on the base as loaded and stored 4-bit; each mode's frozen base bytes
    are the arithmetic's (the 4-bit linears at their codes and absmax, nested where the rank's are whole nested
    blocks), and the ratios are the rows'."""
    out = forkrun.run([sys.executable, str(TOOLS / "bench_peft.py"), "--modes", "lora,qlora", "--world", "1", "--tp",
                       "1", "--hidden", "128", "--ffn", "256", "--layers", "2", "--seq", "16", "--vocab", "256", "--r",
                       "4", "--steps", "1"], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(r["by_mode"]) == {"lora", "qlora"} and r["dtype"] == "float32"
    lora, qlora = r["by_mode"]["lora"], r["by_mode"]["qlora"]
    assert lora["trainable_params"] == qlora["trainable_params"] > 0
    h, f, v, layers = 128, 256, 256, 2  # 2 heads and 2 KV heads of 64
    linears = layers * (h * 3 * h + h * h + 2 * f * h + h * f)
    other = 2 * v * h + layers * 2 * h + h  # embedding, untied head, norms
    assert lora["base_bytes"] == 4 * (linears + other) and r["params"] == linears + other
    # a 64-value block's absmax: nested, a byte each plus a scale and an offset a 256-run and the 8-bit map; QKV's
    # float32 (per KV group its q, k, v rows give runs of 128 absmax: half a nested block each)
    def nested(blocks: int) -> int:
        return blocks + 8 * -(-blocks // 256) + 4 * 256

    absmax = {"qkv": 3 * h * h // 64 * 4, "o": nested(h * h // 64), "gate_up": nested(2 * f * h // 64),
              "down": nested(h * f // 64)}
    assert qlora["base_bytes"] == linears // 2 + layers * sum(absmax.values()) + 4 * other
    assert r["qlora_vs_lora_peak"] == qlora["peak_bytes"] / lora["peak_bytes"]
    assert r["qlora_vs_lora_tokens_per_s"] == qlora["tokens_per_s"] / lora["tokens_per_s"]
