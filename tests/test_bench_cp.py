"""tools/bench_cp.py at a small shape: the JSON contract, the planner's byte count and the split's memory."""

from __future__ import annotations

import json

import pytest
from tool_loader import load_tool


def _tool():
    return load_tool("bench_cp")


def test_small_run_reports_every_cp_size_and_the_planner_counts_its_bytes(capsys):
    summary = _tool().main(["--seq", "256", "--cp", "1", "2", "--layers", "2", "--hidden", "64", "--steps", "1"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert lines[-1] == json.loads(json.dumps(summary))
    assert [r["cp"] for r in lines[:-1]] == [1, 2]
    for r in lines[:-1]:
        assert r["activation_bytes_per_rank"] > 0 and r["tokens_per_s"] > 0
        assert r["predicted_bytes"] == r["activation_bytes_per_rank"], r  # the model counts storages exactly
    one, two = lines[0], lines[1]
    # CP 2 holds half the tokens; the all-gathered K/V and the mask are what it keeps beyond half.
    assert one["activation_bytes_per_rank"] / 2 < two["activation_bytes_per_rank"] < one["activation_bytes_per_rank"]


def test_bad_arguments_exit_2_with_one_message(capsys):
    tool = _tool()
    for argv, field in ((["--seq", "30", "--cp", "4"], "--seq"), (["--hidden", "12"], "--hidden"),
                        (["--cp", "0"], "--cp")):
        with pytest.raises(SystemExit) as e:
            tool.parse_args(argv)
        assert e.value.code == 2
        assert field in capsys.readouterr().err.strip().splitlines()[-1]
