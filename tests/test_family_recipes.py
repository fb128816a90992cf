"""Each family recipe (Qwen3, Gemma 3, Phi-4) runs its CPU preset: a tiny random model of the family with the
stories260K tokenizer, two steps and an evaluation on its eval split, exported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import stories_or_skip
from hfmeg.parallel.launch import spawn
from hfmeg.train import cli
from tiny_models import save_tiny

DATA = Path(__file__).resolve().parents[1] / "data" / "sft_sample.jsonl"


def _recipe(recipe: str, argv: list[str]) -> int:
    return cli.main("test", cli.recipe_config(recipe), argv)


@pytest.mark.parametrize("recipe, kind", [("sft_qwen3", "qwen3"), ("sft_gemma3", "gemma3"), ("sft_phi4", "phi3")])
def test_a_family_recipe_runs_its_cpu_preset(recipe, kind, tmp_path):
    model = save_tiny(kind, tmp_path / kind, vocab_size=512)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(stories_or_skip() / name, model / name)
    out = tmp_path / "out"
    argv = ["--preset", "cpu", "--model", str(model), "--data", str(DATA), "--max-steps", "2", "--seq-len", "64",
            "--global-batch-size", "4", "--eval-every", "2", "--out", str(out)]
    assert spawn(_recipe, 1, recipe, argv) == [0]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2] and any("eval_loss" in r for r in rows)
    assert (out / "hf" / "config.json").is_file()
