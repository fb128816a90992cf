"""tools/kill_sweep.py: a job killed with SIGKILL in the middle of a save resumes to the same model."""

from __future__ import annotations

import json

from test_train import ALPACA, _assets
from tool_loader import load_tool


def test_a_kill_in_the_middle_of_a_save_loses_nothing(tmp_path, capsys):
    model = _assets()
    sweep = load_tool("kill_sweep")
    code = sweep.main(["--model", str(model), "--data", str(ALPACA), "--out", str(tmp_path), "--points", "save-start"])
    lines = capsys.readouterr().out.strip().splitlines()
    row, totals = json.loads(lines[0]), json.loads(lines[-1])
    assert code == 0 and row["point"] == "save-start" and row["killed"] and row["ok"], lines
    assert totals["failed"] == [] and totals["points"] == 1


def test_unknown_points_and_missing_assets_are_one_line(tmp_path, capsys):
    sweep = load_tool("kill_sweep")
    assert sweep.main(["--points", "nowhere"]) == 2
    assert sweep.main(["--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: --points: unknown 'nowhere'; choose from " + ", ".join(sweep.POINTS),
                   f"error: {tmp_path / 'config.json'} is absent: pass --model"]
