"""`--preset cpu`: a recipe's GPU defaults turned into CPU-size ones in one flag, every other flag still on top."""

from __future__ import annotations

import pytest
import yaml

from hfmeg.train import cli


@pytest.fixture(autouse=True)
def _one_process(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("recipe", ["sft_llama13b", "dpo_llama", "sft_qwen3_5"])
def test_the_cpu_preset_sets_cpu_sizes_under_the_flags(capsys, recipe):
    base = ["--model", "no/model", "--data", "d.json", "--print-config", "--preset", "cpu"]
    assert cli.main("test", cli.recipe_config(recipe), base + ["--lr", "1e-2", "--set", "data.seq_len=128"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["optim"]["lr"] == 1e-2 and cfg["data"]["seq_len"] == 128  # the flags win
    assert cfg["data"]["eval_split"] == 0.05 and cfg["train"]["global_batch_size"] == 16
    assert cfg["parallel"]["tp"] == 1 and cfg["lr"]["warmup_steps"] == 5 and cfg["model"]["compile"] is False
