"""tools/bench_powersgd_convergence.py at 3 steps on gloo: the output contract (no loss is asserted).

Each run at 4 rows a step, of 64 tokens (SMALL; the tool's default is 16 rows of 256): what is checked, the rows the
report holds and whether a compressed update changed a logged loss, holds at any batch that yields gradient
matrices of a rank above PowerSGD's 2."""

from __future__ import annotations

import json

import pytest

from helpers import stories_or_skip
from tool_loader import load_tool

SMALL = ["--global-batch-size", "4", "--seq-len", "64"]


def test_tiny_run_reports_each_rank_against_plain(capsys, tmp_path):
    stories_or_skip()
    bench = load_tool("bench_powersgd_convergence")
    assert bench.main(["--steps", "3", "--start", "1", "--ranks", "2", "--plot", str(tmp_path / "c.png"),
                       *SMALL]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(r["runs"]) == ["plain", "powersgd-r2"] and r["start"] == 1
    assert r["runs"]["plain"]["vs_plain"] == 1.0
    assert r["runs"]["powersgd-r2"]["vs_plain"] != 1.0  # the compressed update changed the last step's loss
    assert (tmp_path / "c.png").is_file()


def test_from_scratch_pretrains_the_reshaped_architecture_on_text(capsys):
    stories_or_skip()
    bench = load_tool("bench_powersgd_convergence")
    assert bench.main(["--from-scratch", "--layers", "2", "--hidden", "32", "--heads", "4", "--steps", "3",
                       "--start", "1", "--ranks", "2", "--seq-len", "32", "--global-batch-size", "4"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["from_scratch"] and r["shape"] == {"hidden": 32, "layers": 2, "heads": 4}
    assert list(r["runs"]) == ["plain", "powersgd-r2"] and r["runs"]["powersgd-r2"]["vs_plain"] != 1.0


def test_several_starts_give_a_run_per_start_and_rank(capsys):
    stories_or_skip()
    bench = load_tool("bench_powersgd_convergence")
    assert bench.main(["--steps", "3", "--start", "1", "2", "--ranks", "2", *SMALL]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(r["runs"]) == ["plain", "powersgd-r2-from1", "powersgd-r2-from2"] and r["start"] == [1, 2]
    # compressed from step 1 changes step 2's update, hence step 3's loss; from step 2 changes nothing logged
    assert r["runs"]["powersgd-r2-from1"]["vs_plain"] != 1.0 and r["runs"]["powersgd-r2-from2"]["vs_plain"] == 1.0


def test_shape_flags_need_from_scratch():
    bench = load_tool("bench_powersgd_convergence")
    with pytest.raises(SystemExit) as e:
        bench.main(["--layers", "2"])
    assert e.value.code == 2
