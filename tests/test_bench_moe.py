"""tools/bench_moe.py at tiny size on gloo: the output contract and what the byte counts must satisfy
whatever the timings (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import forkrun

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _run(*args: str) -> subprocess.CompletedProcess:
    return forkrun.run([sys.executable, str(TOOLS / "bench_moe.py"), *args],
                          timeout=300)


def test_bench_moe_reports_every_ep_size_and_its_all_to_all_bytes():
    out = _run("--world", "4", "--ep", "1", "2", "4", "--tokens", "64", "--hidden", "32", "--ffn", "48",
               "--experts", "4", "--top-k", "2", "--reps", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["flops_per_token"] == 6 * (32 * 4 + 2 * 3 * 32 * 48)
    one, two, four = (r["by_ep"][ep] for ep in ("1", "2", "4"))
    assert one["all_to_all_bytes_per_rank"] == 0 and one["vs_ep1"] == 1.0
    routed = 2 * 64 * 2 * 32 * 4  # every routed row out and back, at most
    for row, ep in ((two, 2), (four, 4)):
        assert row["all_to_all_min_bytes"] == routed * (ep - 1) / ep
        assert 0 < row["all_to_all_bytes_per_rank"] <= routed
        assert 0.5 < row["bytes_vs_min"] < 1.5  # a random router balances roughly
        assert row["tokens_per_s"] > 0 and row["tflops"] > 0


def test_bench_moe_refuses_an_ep_that_does_not_divide():
    out = _run("--world", "4", "--ep", "3")
    assert out.returncode == 2 and "--ep [3] must divide --world 4" in out.stderr
