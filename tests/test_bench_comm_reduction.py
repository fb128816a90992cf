"""tools/bench_comm_reduction.py at tiny size on gloo: every case runs, and the byte counts
follow the algorithms (no timing is asserted)."""

from __future__ import annotations

import json

from tool_loader import load_tool


def test_tiny_run_reports_every_case(capsys):
    bench = load_tool("bench_comm_reduction")
    assert bench.main(["--hidden", "64", "--layers", "2", "--vocab", "512", "--seq", "16", "--steps", "1",
                       "--ranks", "1", "4", "--bucket-size", "20000"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = r["cases"]
    assert list(rows) == [name for name, _, _ in bench.cases([1, 4])]
    anchor = rows["overlapped"]
    # Uncompressed sharded DP=2: half of every bucket out in the reduce-scatter, half in the all-gather.
    assert r["params"] * 4 <= anchor["computed_bytes"] < r["params"] * 4 + 4 * 20
    for k in (1, 4):
        assert rows[f"ddp-powersgd-r{k}"]["computed_bytes"] == rows[f"torch-powersgd-r{k}"]["computed_bytes"]
        # the all-gather stays: a sharded mode saves at most the gradient half
        assert 0.5 < rows[f"powersgd-r{k}"]["bytes_vs_overlapped"] < 1
        assert rows[f"ddp-powersgd-r{k}"]["computed_bytes"] < rows[f"powersgd-r{k}"]["computed_bytes"] / 2
    assert all(row["step_s"] > 0 and row["measured_bytes"] is None for row in rows.values())
    # The shared phase moves the two layers once: layer 0's parameters plus everything outside the layers.
    layer = 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64  # q, k, v, o; gate, up, down (ffn 8/3 x 64, floored to 64); norms
    shared = r["params"] - layer  # the second layer's own tensors are gone
    assert shared * 4 <= rows["overlapped-shared"]["computed_bytes"] < shared * 4 + 4 * 20


def test_bf16_parameters_gather_half_the_bytes(capsys):
    """bf16 parameters: fp32 gradient sums, a bf16 all-gather, so the compressed sharded step moves ~1/3."""
    bench = load_tool("bench_comm_reduction")
    assert bench.main(["--hidden", "64", "--layers", "2", "--vocab", "512", "--seq", "16", "--steps", "1",
                       "--ranks", "4", "--bucket-size", "20000", "--dtype", "bf16"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows, n = r["cases"], r["params"]
    assert r["dtype"] == "bf16"
    # DP=2: half of the fp32 gradient out in the reduce-scatter, half of the bf16 parameters in the all-gather
    assert n * 3 <= rows["overlapped"]["computed_bytes"] < n * 3 + 3 * 20
    assert 1 / 3 < rows["powersgd-r4"]["bytes_vs_overlapped"] < 0.5
    # torch's hook sums the bf16 gradients in bf16: half of hfmeg's fp32 factors
    assert rows["torch-powersgd-r4"]["computed_bytes"] * 2 == rows["ddp-powersgd-r4"]["computed_bytes"]
