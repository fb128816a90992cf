"""tools/bench_optimizer.py, tools/bench_optimizer_bytes.py and tools/bench_collectives.py at tiny size on gloo:
the output contract, and what the figures must satisfy whatever the timings (no timing is asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import forkrun

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _last_json(*args: str) -> dict:
    out = forkrun.run([sys.executable, *args], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_bench_optimizer_tiny_run_reports_every_mode():
    r = _last_json(str(TOOLS / "bench_optimizer.py"), "--dp", "2", "--hidden", "64", "--layers", "2",
                   "--vocab", "512", "--seq", "16", "--ga", "1", "2", "--steps", "2", "--warmup", "1",
                   "--bucket-size", "20000")
    assert r["dp"] == 2 and r["ga"] == 1 and r["throttle"] is None
    for key in ("ddp_step_s", "distributed_step_s", "overlapped_step_s"):
        assert r[key] > 0
    assert r["overlapped_vs_distributed"] == r["overlapped_step_s"] / r["distributed_step_s"]
    assert r["overlapped_vs_ddp"] == r["overlapped_step_s"] / r["ddp_step_s"]
    # Sharded state: (master + m + v) / DP plus under DP elements of padding per bucket; DDP holds it all.
    assert r["ddp_opt_state_bytes_per_rank"] == 12 * r["params"]
    assert 6 * r["params"] <= r["opt_state_bytes_per_rank"] < 6 * r["params"] + 12 * 20
    for ga in ("1", "2"):
        rows = r["by_ga"][ga]
        assert set(rows) == {"compute", "ddp", "distributed", "overlapped"}
        for row in rows.values():
            assert row["step_s"] > 0 and row["cpu_per_step_s"] > 0
    assert set(r["comm_only_s"]) == {"allreduce", "sharded"}


def test_bench_collectives_tiny_run():
    r = _last_json(str(TOOLS / "bench_collectives.py"), "--numel", "100000", "--reps", "2")
    keys = {"all_reduce", "native_reduce_scatter", "native_all_gather", "hfmeg_reduce_scatter",
            "hfmeg_all_gather", "adamw_foreach_s", "adamw_fused_s"}
    assert keys <= set(r) and all(r[k] > 0 for k in keys)
    # What was timed computes what it replaces: hfmeg's reduce-scatter and all-gather equal the native ones.
    assert r["hfmeg_matches_native"] is True and (r["dp"], r["numel"]) == (2, 100000)


def test_bench_optimizer_bytes_counts_one_pass_per_kernel_and_no_clip_pass_when_fused():
    r = _last_json(str(TOOLS / "bench_optimizer_bytes.py"), "--hidden", "64", "--layers", "2", "--vocab", "512",
                   "--seq", "16")
    fused, foreach, plain = (r["rows"][k] for k in ("hfmeg fused", "hfmeg foreach", "torch"))
    # Per parameter (fp32 master, moments and main grad; bf16 parameter): fused AdamW reads and writes the
    # master, the main grad (its schema declares it written) and both moments, 4 x 8 B; the publish reads the
    # fp32 master and writes the bf16 parameter, 6 B; the norm reads the gradient, 4 B; zeroing writes it, 4 B.
    # What is left is 0-d tensors (AdamW's step counts, the per-tensor norms): under 64 B per parameter tensor,
    # of which a LLaMA has 9 per layer plus the embedding, the final norm and the LM head.
    scalars = 64 * (9 * 2 + 3) / r["params"]
    want = {"_fused_adamw_": 32, "copy_": 6, "_foreach_norm": 4, "zero_": 4}
    for op, b in want.items():
        assert abs(fused["by_op"][op] - b) < scalars, (op, fused["by_op"][op])
    assert abs(fused["bytes_per_param"] - sum(want.values())) < scalars
    assert "_foreach_mul_" not in fused["by_op"]  # clip and loss scale ride in AdamW's grad_scale
    assert foreach["by_op"]["_foreach_mul_"] >= 8  # the foreach AdamW cannot take them: one more r+w pass
    assert abs(plain["bytes_per_param"] - 48) < scalars  # the anchor clips with a multiply and zeroes fp32 grads
    assert fused["vs_torch"] == fused["bytes_per_param"] / plain["bytes_per_param"]
