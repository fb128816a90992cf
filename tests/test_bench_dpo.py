"""tools/bench_dpo.py at small size on gloo: its output contract, and the memory claim it measures: LoRA-DPO holds
one copy of the base, so its peak is at least one model copy below full DPO's (which holds the policy, a frozen
reference copy, fp32 main grads and Adam state). Timings are reported, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import stories_or_skip

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def test_bench_dpo_reports_every_mode_and_lora_saves_a_copy():
    stories_or_skip()
    out = subprocess.run([sys.executable, str(TOOLS / "bench_dpo.py"), "--hidden", "512", "--layers", "2",
                          "--seq", "64", "--steps", "1", "--pairs", "16"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    modes = r["by_mode"]
    assert set(modes) == {"full", "full_simpo", "lora", "trl"}
    for row in modes.values():
        assert row["answer_tokens_per_s"] > 0 and row["peak_bytes"] > 0 and row["steps"] == 1
    assert r["full_vs_trl_tokens_per_s"] == modes["full"]["answer_tokens_per_s"] / modes["trl"]["answer_tokens_per_s"]
    assert modes["lora"]["peak_bytes"] <= modes["full"]["peak_bytes"] - r["model_bytes"], r
