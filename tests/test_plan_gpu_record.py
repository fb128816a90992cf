"""The planner against measurements recorded on a GPU (docs/measurements/, README "Measured on a GPU").

The records are `tools/bench_mfu.py` results and the `hfmeg plan calibrate --device cuda`
profile of the same H100. This runs on any machine: a change to the memory or step-time
model that moves its predictions away from what the GPU measured fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

from tool_loader import load_tool

RECORDS = Path(__file__).resolve().parents[1] / "docs" / "measurements"


def test_h100_memory_within_10_percent_and_step_time_within_10_percent(capsys):
    tool = load_tool("check_plan_gpu")
    assert tool.main([str(RECORDS / "h100_bench_mfu.jsonl"), "--profile", str(RECORDS / "h100_profile.json"),
                      "--gpu", "h100"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows, summary = [json.loads(x) for x in lines[:-1]], json.loads(lines[-1])
    assert summary["rows"] == len(rows) >= 5 and summary["profile"].startswith("NVIDIA H100")
    assert {r["recompute"] for r in rows} == {"none", "selective", "full"}
    for r in rows:
        assert abs(r["memory_error"]) <= 0.10, r
    assert summary["median_abs_time_error"] <= 0.10


def test_h100_mixtral_memory_within_10_percent_and_step_time_within_35_percent(capsys):
    """Mixtral-shaped rows (8 experts, top-2, EP 1): memory is counted as closely as for dense
    models; step time is the model's known gap (predicted too fast, README), guarded from widening."""
    tool = load_tool("check_plan_gpu")
    assert tool.main([str(RECORDS / "h100_bench_mfu_moe.jsonl"), "--profile", str(RECORDS / "h100_profile.json"),
                      "--gpu", "h100"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [json.loads(x) for x in lines[:-1]]
    assert len(rows) == 2 and {(r["experts"], r["top_k"]) for r in rows} == {(8, 2)}
    for r in rows:
        assert abs(r["memory_error"]) <= 0.10, r
        assert abs(r["time_error"]) <= 0.35, r


def test_unreadable_results_are_one_line_errors(tmp_path, capsys):
    tool = load_tool("check_plan_gpu")
    empty = tmp_path / "log.txt"
    empty.write_text("no JSON here\n")
    assert tool.main([str(empty), "--profile", str(RECORDS / "h100_profile.json"), "--gpu", "h100"]) == 2
    assert "holds no bench_mfu result" in capsys.readouterr().err
