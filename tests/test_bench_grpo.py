"""tools/bench_grpo.py at small size: both sides run the same number of steps on the same prompts and settings and
its rates and ratios are what its counts make them. Timings are reported, never asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import stories_or_skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
pytest.importorskip("trl")


def test_bench_grpo_reports_both_sides_and_their_ratios():
    stories_or_skip()
    from bench_grpo import main

    r = main(["--steps", "2", "--warmup", "1", "--batch", "8", "--num-generations", "4",
              "--max-completion-length", "8"])
    for side in ("hfmeg", "trl"):
        row = r[side]
        # one measured step of 8 completions of 1..8 tokens each
        assert 8 <= row["tokens"] <= 8 * 8, (side, row)
        assert 0 < row["gen_s"] < row["step_s"] and row["train_s"] > 0, (side, row)
        assert row["generation_tokens_per_s"] == row["tokens"] / row["gen_s"]
    assert len(r["hfmeg"]["reward"]) == 1
    for k, v in r["ratio"].items():
        assert v == r["hfmeg"][k] / r["trl"][k]
