"""tools/bench_activations.py at small shapes: JSON contract and the per-layer figures' invariants."""

from __future__ import annotations

import json

import pytest
from tool_loader import load_tool



def _tool():
    return load_tool("bench_activations")


def test_small_run_orders_the_modes_and_full_keeps_only_the_layer_input(capsys):
    rows = _tool().main(["--hidden", "64", "--ffn", "176", "--heads", "4", "--seq", "32", "--tp", "2", "--sp"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert lines == json.loads(json.dumps(rows))
    by = {r["recompute"]: r for r in lines}
    assert set(by) == {"none", "selective", "full"}
    # Full recompute keeps one bf16 copy of the layer's (sequence-parallel) input: 2 bytes x s/tp x b x h.
    assert by["full"]["bytes_per_layer"] == 2 * 16 * 1 * 64 and by["full"]["sbh_multiple"] == 1.0
    assert by["full"]["bytes_per_layer"] < by["selective"]["bytes_per_layer"] < by["none"]["bytes_per_layer"]


def test_bad_arguments_exit_2_with_one_message(capsys):
    tool = _tool()
    for argv, field in ((["--heads", "7"], "--heads"), (["--sp"], "--sp"), (["--seq", "0"], "--seq")):
        with pytest.raises(SystemExit) as e:
            tool.parse_args(argv)
        assert e.value.code == 2
        assert field in capsys.readouterr().err.strip().splitlines()[-1]
