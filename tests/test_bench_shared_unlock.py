"""tools/bench_shared_unlock.py at a few steps on gloo: the output contract, and the volumes each phase reduces
and holds (the losses are not asserted: a few steps say nothing about convergence)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import forkrun
from helpers import stories_or_skip

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _run(*args: str) -> subprocess.CompletedProcess:
    return forkrun.run([sys.executable, str(TOOLS / "bench_shared_unlock.py"), *args], timeout=600)


def test_bench_shared_unlock_reports_three_runs_and_the_shared_phase_volume(tmp_path):
    model = stories_or_skip()
    png = tmp_path / "curves.png"
    out = _run("--config-from", str(model), "--layers", "3", "--steps", "4", "--until", "2", "--seq-len", "32",
               "--plot", str(png))
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert list(r["runs"]) == ["plain", "shared", "shared+powersgd"] and png.is_file()
    plain, shared = r["runs"]["plain"], r["runs"]["shared"]
    assert plain["final_vs_plain"] == 1.0 and shared["last_phase"] == plain["first_phase"]
    # stories260K's shape with 3 layers of 45,440 parameters, 65,600 outside them (embedding, head, final
    # norm); DP2 buckets are padded to even sizes.
    layer, other = 45_440, 65_600
    assert 0 <= plain["first_phase"]["dp_elements"] - (3 * layer + other) < 10
    assert 0 <= shared["first_phase"]["dp_elements"] - (layer + other) < 10
    for phase in (plain["first_phase"], shared["first_phase"]):  # fp32 master + 2 moments of a DP2 shard
        assert phase["state_bytes"] == 12 * phase["dp_elements"] // 2

