"""Shared-unlock warm start in the trainer and the pretrain recipe (issue 16).

Pretraining from scratch (`model.init random`, stories260K's 5-layer architecture and
tokenizer) on the project's text sample, layers shared until step 3:
- resuming from a checkpoint before the switch (also resharded to TP2), at it (a shared-phase checkpoint
  loaded into the unlocked model) and after it reproduces the uninterrupted run bit
  for bit; the checkpoints record their phase, and a shared-phase one exports a
  complete HF model whose layers all hold the shared weights;
- with PowerSGD from the unlock on, a resume after both switch-overs is exact too;
- the recipe command line trains, unlocks, exports, and transformers loads the export;
- what the feature does not support is refused naming the field.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from bounds import within
from helpers import script_rank, stories_or_skip
from hfmeg.checkpoint import hub_source
from hfmeg.checkpoint.convert import mp_to_hf
from hfmeg.data import DataConfig, SourceConfig
from hfmeg.optim.config import OptimizerConfig
from hfmeg.optim.lr_schedule import LRScheduleConfig
from hfmeg.parallel.launch import WorkerError, spawn
from hfmeg.train import cli
from hfmeg.train.checkpointing import STATE_FILE
from hfmeg.train.config import CheckpointArgs, LoopArgs, ModelArgs, ParallelArgs, TrainConfig
from hfmeg.train.metrics import read_metrics
from hfmeg.train.trainer import Trainer
from tiny_models import save_tiny
from tool_loader import load_tool

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "data" / "text_sample.txt"
PRETRAIN = cli.recipe_config("pretrain_llama")
UNTIL, STEPS = 3, 6


def _config(out: Path, *, steps=STEPS, resume="none", until=UNTIL, tp=1) -> TrainConfig:
    return TrainConfig(
        model=ModelArgs(init="random", config_from=str(stories_or_skip()), dtype="fp32"),
        parallel=ParallelArgs(tp=tp),
        optim=OptimizerConfig(lr=3e-3, weight_decay=0.01, eps=1e-5, bucket_size=20000),
        lr=LRScheduleConfig(warmup_steps=1, total_steps=STEPS, min_lr=3e-4),
        data=DataConfig(sources=[SourceConfig(str(TEXT))], format="text", overlong="split", seq_len=64),
        train=LoopArgs(micro_batch_size=1, global_batch_size=4, max_steps=steps, shared_layers_until=until),
        checkpoint=CheckpointArgs(out=str(out), resume=resume, keep_last=3),
        report_to=[],
    )


def _run(cfg: TrainConfig) -> None:
    Trainer(cfg).run()


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def _phase(checkpoint: Path) -> bool:
    return json.loads((checkpoint / STATE_FILE).read_text())["shared_layers"]


def test_resume_before_at_and_after_the_unlock_is_exact(tmp_path):
    spawn(_run, 2, _config(tmp_path / "straight"))
    straight = _losses(tmp_path / "straight")
    ckpts = tmp_path / "straight" / "checkpoints"
    assert len(straight) == STEPS
    assert _phase(ckpts / "iter_0000003") and not _phase(ckpts / "iter_0000006")  # the unlock's checkpoint

    # Before the switch (step 2, shared) and after it (step 4, unlocked): stop, resume, compare.
    for stop in (2, 4):
        out = tmp_path / f"split{stop}"
        spawn(_run, 2, _config(out, steps=stop))
        assert _phase(out / "checkpoints" / f"iter_{stop:07d}") == (stop < UNTIL)
        if stop == 2:  # a shared-phase checkpoint resharded to TP2 resumes too (TP sums: not bit for bit)
            new = tmp_path / "tp2"
            assert load_tool("reshard_mp").main(["--mp", str(out / "checkpoints" / "iter_0000002"), "--out", str(new),
                                                  "--tp", "2", "--pp", "1"]) == 0
            spawn(_run, 2, _config(tmp_path / "tp2run", resume=str(new / "iter_0000002"), tp=2))
            got = _losses(tmp_path / "tp2run")
            assert len(got) == 4, (got, straight)
            # Every run in launch.spawn ranks, one thread each whatever OMP_NUM_THREADS or the load: no thread count moves
            # these losses (docs/testing.md, bounds). 1e-5: 4 steps of fp32 sums in the TP2 order (~1e-7 per op).
            within(max(abs(a - b) / b for a, b in zip(got, straight[2:])), 1e-5, "TP2 resume loss rel", (got, straight))
        spawn(_run, 2, _config(out, resume="auto"))
        assert _losses(out) == straight, (stop, _losses(out), straight)

    # At the switch: the shared-phase checkpoint of step 3 loads straight into the unlocked model.
    spawn(_run, 2, _config(tmp_path / "at3", resume=str(ckpts / "iter_0000003")))
    assert _losses(tmp_path / "at3") == straight[UNTIL:]

    # A shared-phase checkpoint is a complete model: every layer holds the shared weights.
    hf = mp_to_hf(ckpts / "iter_0000003", tmp_path / "hf3")
    model = AutoModelForCausalLM.from_pretrained(hf)
    layers = model.model.layers
    assert len(layers) == 5
    for layer in layers[1:]:
        for (name, p), q in zip(layer.named_parameters(), layers[0].parameters()):
            assert torch.equal(p, q), name
    unlocked = AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "hf").model.layers
    assert not torch.equal(unlocked[1].mlp.up_proj.weight, unlocked[0].mlp.up_proj.weight)

    # Unshared layers cannot be shared again.
    with pytest.raises(WorkerError, match="train.shared_layers_until: the checkpoint at step 6 has unshared"):
        spawn(_run, 2, _config(tmp_path / "straight", steps=10, until=8, resume="auto"))


def test_powersgd_from_the_unlock_on_resumes_exactly(tmp_path):
    """Both switch-overs at step 3 (shared -> unlocked, warm-up -> compressed): a resume at 4 is bit for bit."""
    def config(out, **kw):
        cfg = _config(out, **kw)
        cfg.optim = replace(cfg.optim, compression="powersgd", powersgd_rank=2, compression_start_step=UNTIL)
        return cfg

    spawn(_run, 2, config(tmp_path / "straight"))
    spawn(_run, 2, config(tmp_path / "split", steps=4))
    spawn(_run, 2, config(tmp_path / "split", resume="auto"))
    straight = _losses(tmp_path / "straight")
    assert _losses(tmp_path / "split") == straight
    spawn(_run, 2, _config(tmp_path / "plain"))
    plain = _losses(tmp_path / "plain")  # step 3's loss comes before its update, the first compressed one
    assert plain[:4] == straight[:4] and plain[4:] != straight[4:]


def test_pretrain_recipe_from_random_weights_unlocks_and_exports(tmp_path, capfd):
    model = stories_or_skip()
    out = tmp_path / "run"
    # one launch.spawn rank runs the script (the plain `python recipe` start: test_run_lifecycle.py)
    capfd.readouterr()
    assert spawn(script_rank, 1, str(ROOT / "recipes" / "pretrain_llama.py"), [
        "--init", "random", "--config-from", str(model), "--data", str(TEXT), "--set",
        f"train.shared_layers_until={UNTIL}", "--tp", "1", "--no-sequence-parallel", "--max-steps", "5", "--seq-len",
        "64", "--global-batch-size", "4", "--lr", "3e-3", "--warmup-steps", "1", "--set", "data.eval_split=0",
        "--eval-every", "0", "--out", str(out), "--resume", "none"]) == [0]
    assert f"step {UNTIL}: layers unlocked" in capfd.readouterr().out
    assert len(_losses(out)) == 5
    loaded = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert len(loaded.model.layers) == 5
    assert (out / "hf" / "tokenizer.json").is_file()
    card = (out / "hf" / "README.md").read_text()
    assert "Pretrained from random weights with the architecture and tokenizer of **stories260K**" in card
    assert "base_model" not in card.split("---")[1]


@pytest.fixture
def _one_process(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("argv, expect", [
    (["--init", "random"], "model.config_from: model.init random needs"),
    (["--init", "random", "--config-from", "x", "--model", "y"], "model.path: 'y' is given"),
    (["--config-from", "x", "--model", "y"], "model.config_from: only read with model.init random"),
    (["--model", "y", "--set", "train.shared_layers_until=3"], "train.shared_layers_until: sharing gives every layer"),
    (["--init", "random", "--config-from", "x", "--set", "train.shared_layers_until=-1"],
     "train.shared_layers_until: must be >= 0"),
    (["--init", "random", "--config-from", "x", "--set", "train.shared_layers_until=3", "--pp", "2"],
     "train.shared_layers_until: shared layers need every layer on one rank"),
    (["--init", "random", "--config-from", "x", "--set", "train.shared_layers_until=30", "--set",
      "optim.compression=powersgd", "--set", "optim.compression_start_step=20"],
     "optim.compression_start_step: 20 is before train.shared_layers_until 30"),
])
def test_refusals_name_the_field(_one_process, capsys, monkeypatch, argv, expect):
    monkeypatch.setenv("WORLD_SIZE", "2")
    base = ["--data", "no-data.txt", "--tp", "1", "--out", "never-written"]
    assert cli.main("test", PRETRAIN, base + argv) == 2
    out, err = capsys.readouterr()
    assert expect in err and len((out + err).strip().splitlines()) == 1, out + err


def test_moe_models_are_refused_naming_the_field(_one_process, capsys, tmp_path):
    moe = save_tiny("mixtral", tmp_path / "mixtral")
    argv = ["--init", "random", "--config-from", str(moe), "--data", "no-data.txt", "--tp", "1", "--out", "never",
            "--set", "train.shared_layers_until=2"]
    assert cli.main("test", PRETRAIN, argv) == 2
    assert "train.shared_layers_until: shared layers are for dense models" in capsys.readouterr().err


def test_random_init_fetches_only_config_and_tokenizer_from_the_hub(monkeypatch, tmp_path):
    asked = []

    def fake_download(repo_id, allow_patterns, local_files_only):
        asked.append(allow_patterns)
        return str(tmp_path)

    monkeypatch.setattr(hub_source, "snapshot_download", fake_download)
    assert ModelArgs(init="random", config_from="org/model").hf_folder() == tmp_path
    assert asked == [hub_source.SIDE_PATTERNS]  # no weight files, and no second try for .bin ones
