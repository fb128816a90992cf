"""A LoRA job killed with SIGKILL mid-run resumes (`--resume auto`) bit for bit, and the trainer's command
line refuses, in one line and exit 2, to resume its adapters onto a base whose weights changed."""

from __future__ import annotations

import json
import shutil

import forkrun
from helpers import stories_or_skip
from safetensors.torch import load_file, save_file
from test_train import ALPACA
from tool_loader import load_tool


def test_a_killed_lora_run_resumes_bit_for_bit_and_a_changed_base_is_refused(tmp_path, capsys):
    base = tmp_path / "base"
    shutil.copytree(stories_or_skip(), base)
    sweep = load_tool("kill_sweep")
    # save-commit: killed when the step-4 checkpoint is committed, mid-run (steps 1-6, saves every 2).
    code = sweep.main(["--model", str(base), "--data", str(ALPACA), "--out", str(tmp_path / "sweep"),
                       "--points", "save-commit", "--peft", "lora"])
    lines = capsys.readouterr().out.strip().splitlines()
    row = json.loads(lines[0])
    # ok: hf/ and adapter/ hold the uninterrupted run's tensors and metrics.jsonl its losses, bit for bit.
    assert code == 0 and row["killed"] and row["ok"], lines
    weights = load_file(str(base / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.01
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    cmd = sweep.command(base, ALPACA, tmp_path / "sweep" / "reference", "lora") + ["--max-steps", "8"]
    proc = forkrun.run(cmd, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    # stderr: the config's warnings (here warm-up >= max steps), then the one error line
    err = [line for line in proc.stderr.strip().splitlines() if not line.startswith("warning: ")]
    assert len(err) == 1 and "differ from the base the checkpoint's adapters were trained on" in err[0], err
