"""tools/bench_optimizer.py and tools/bench_collectives.py at tiny size on gloo: the
output contract, and what the figures must satisfy whatever the timings (no timing
is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _last_json(*args: str) -> dict:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
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
