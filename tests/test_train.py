"""End-to-end training: layouts, layout parity, resume, SIGTERM, export, CLI.

All runs fine-tune stories260K (or a tiny random LLaMA where noted) on
alpaca_en_demo.json with short sequences so that each run takes seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from bounds import within
import forkrun
from helpers import script_rank, stories_or_skip
from hfmeg.data import DataConfig, SourceConfig
from hfmeg.optim.config import OptimizerConfig
from hfmeg.optim.lr_schedule import LRScheduleConfig
from hfmeg.parallel.launch import spawn
from hfmeg.train.config import CheckpointArgs, LoopArgs, ModelArgs, ParallelArgs, TrainConfig
from hfmeg.train.metrics import read_metrics
from hfmeg.train.trainer import Trainer
from tiny_models import ASSETS

ROOT = Path(__file__).resolve().parents[1]
ALPACA = ASSETS / "data" / "alpaca_en_demo.json"


def _config(out: Path, model: Path, *, tp=1, pp=1, steps=10, save_every=0, resume="none", gbs=8, lr=2e-3,
            sp=False, schedule_steps=None, eval_every=0, eval_split=0, powersgd_from=None) -> TrainConfig:
    compression = dict(compression="powersgd", powersgd_rank=2, compression_start_step=powersgd_from) \
        if powersgd_from is not None else {}
    return TrainConfig(
        model=ModelArgs(path=str(model), dtype="fp32"),
        parallel=ParallelArgs(tp=tp, pp=pp, sequence_parallel=sp),
        optim=OptimizerConfig(lr=lr, weight_decay=0.01, eps=1e-5, **compression),
        lr=LRScheduleConfig(warmup_steps=2, total_steps=schedule_steps or steps, min_lr=lr / 10),
        data=DataConfig(sources=[SourceConfig(str(ALPACA))], seq_len=64, eval_split=eval_split),
        train=LoopArgs(micro_batch_size=1, global_batch_size=gbs, max_steps=steps, eval_every=eval_every,
                       eval_batches=2),
        checkpoint=CheckpointArgs(out=str(out), save_every=save_every, resume=resume, keep_last=2),
        report_to=[],
    )


def _run(cfg: TrainConfig):
    r = Trainer(cfg).run()
    return r.hf_folder, r.checkpoint


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def _assets():
    model = stories_or_skip()
    if not ALPACA.is_file():
        pytest.skip(f"{ALPACA} is absent")
    return model


@pytest.mark.parametrize("tp, pp, world", [(2, 2, 4), (2, 1, 4)])
def test_finetune_exports_a_working_model(tp, pp, world, tmp_path):
    """TP2xPP2 and TP2xDP2: loss goes down, export loads in transformers, parity holds."""
    model = _assets()
    out = tmp_path / "run"
    cfg = _config(out, model, tp=tp, pp=pp, steps=30, sp=True, lr=5e-3, eval_every=15, eval_split=16)
    hf, ckpt = spawn(_run, world, cfg)[0]
    losses = _losses(out)
    assert len(losses) == 30
    evals = [r["eval_loss"] for r in read_metrics(out / "metrics.jsonl") if "eval_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0], evals
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, losses
    rows = read_metrics(out / "metrics.jsonl")
    assert set(rows[0]) >= {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "skipped"}
    assert (out / "loss.png").is_file() and (out / "config.yaml").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(hf)
    AutoTokenizer.from_pretrained(hf)
    card = (Path(hf) / "README.md").read_text()
    assert "## Metrics at the last step\n" in card and "| loss |" in card, card
    # The exported weights are the trained ones, not the base model's.
    base = AutoModelForCausalLM.from_pretrained(model)
    assert not torch.equal(loaded.model.norm.weight, base.model.norm.weight)
    proc = forkrun.run([sys.executable, str(ROOT / "tools" / "verify_parity.py"), "--mp", str(ckpt),
                        "--hf", str(hf)], timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "max_abs_logit_diff=" in proc.stdout


def test_layout_parity_1_vs_tp2_pp2_dp2(tmp_path):
    """One process and TP2xPP2xDP2 (8 processes) see the same batches: same losses."""
    model = _assets()
    spawn(_run, 1, _config(tmp_path / "single", model, steps=20, gbs=8))
    spawn(_run, 8, _config(tmp_path / "grid", model, tp=2, pp=2, steps=20, gbs=8, sp=True))
    a, b = _losses(tmp_path / "single"), _losses(tmp_path / "grid")
    assert len(a) == len(b) == 20
    # Every run in launch.spawn ranks, one thread each whatever OMP_NUM_THREADS or the load: no thread count moves
    # these losses (docs/testing.md, bounds). The layout contract's 1e-4: fp32 sums in other orders over 20 Adam steps.
    within(max(abs(x - y) / abs(x) for x, y in zip(a, b)), 1e-4, "1 process vs TP2xPP2xDP2 loss rel", (a, b))


def test_resume_continues_identically(tmp_path):
    """8 steps straight == 4 steps, stop, resume for 4 more (TP2 x DP2), bit for bit.

    What a resume must restore (weights, Adam's moments and step, the LR schedule's position past its warm-up, the
    data stream, the RNG) is all in play from step 3 on: more steps would only repeat the same comparison."""
    model = _assets()
    spawn(_run, 4, _config(tmp_path / "straight", model, tp=2, steps=8))
    # The interrupted run stops at step 4 of the same 8-step LR schedule.
    spawn(_run, 4, _config(tmp_path / "split", model, tp=2, steps=4, save_every=2, schedule_steps=8))
    spawn(_run, 4, _config(tmp_path / "split", model, tp=2, steps=8, resume="auto"))
    straight, split = _losses(tmp_path / "straight"), _losses(tmp_path / "split")
    assert len(split) == 8
    kept = sorted(p.name for p in (tmp_path / "split" / "checkpoints").glob("iter_*"))
    assert kept == ["iter_0000004", "iter_0000008"]  # keep_last=2: iter 2 was pruned
    assert split == straight, (split, straight)


def test_resume_across_the_powersgd_switch(tmp_path):
    """PowerSGD from step 3 (DP2): 8 steps straight == 4 steps, stop, resume for 4 more, bit for bit."""
    model = _assets()
    spawn(_run, 2, _config(tmp_path / "straight", model, steps=8, powersgd_from=3))
    spawn(_run, 2, _config(tmp_path / "split", model, steps=4, schedule_steps=8, powersgd_from=3))
    assert len(list((tmp_path / "split" / "checkpoints" / "iter_0000004" / "optim").glob("powersgd_*"))) == 2
    spawn(_run, 2, _config(tmp_path / "split", model, steps=8, resume="auto", powersgd_from=3))
    straight, split = _losses(tmp_path / "straight"), _losses(tmp_path / "split")
    assert len(split) == 8 and split == straight, (split, straight)
    # Uncompressed, the same 8-step schedule, as far as the first loss after the first compressed update: step 4's
    # loss comes before that update, step 5's after it (the later steps' differ by that same update, and more).
    spawn(_run, 2, _config(tmp_path / "plain", model, steps=5, schedule_steps=8))
    plain = _losses(tmp_path / "plain")
    assert len(plain) == 5 and plain[:4] == straight[:4] and plain[4] != straight[4]


def test_sigterm_leaves_a_resumable_checkpoint(tmp_path):
    """SIGTERM to torchrun mid-run: every rank saves the same step; the run resumes from it."""
    model = _assets()
    out = tmp_path / "run"
    recipe = [str(ROOT / "recipes" / "sft_llama13b.py"), "--model", str(model), "--data", str(ALPACA),
              "--tp", "2", "--seq-len", "64", "--global-batch-size", "4", "--out", str(out),
              "--report-to", "none", "--max-steps", "100000"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *recipe]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.time() + 300
    while not (out / "metrics.jsonl").is_file() or len(_losses(out)) < 3:
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else ""
        time.sleep(0.5)
    # torchrun's agent forwards SIGTERM to the workers and then reports the signal in its own
    # exit status; what matters is what the workers left behind.
    proc.send_signal(signal.SIGTERM)
    log, _ = proc.communicate(timeout=300)
    assert "SIGTERM: saved step" in log, log
    latest = (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip()
    step = int(latest)
    assert step == len(_losses(out)) >= 3, log
    state = json.loads((out / "checkpoints" / f"iter_{step:07d}" / "trainer_state.json").read_text())
    assert state["step"] == step
    assert not (out / "hf").exists()  # a stopped run is not exported
    before = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    # The recipe resumes automatically (checkpoint.resume: auto); the same schedule needs the same max-steps. The
    # resume is what is checked here, not a launcher's start: the recipe's 2 ranks in launch.spawn (no torchrun).
    assert spawn(script_rank, 2, recipe[0], [*recipe[1:], "--set", f"train.max_steps={step + 2}"]) == [0, 0]
    after = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    # resumed, not started again: the stopped run's rows are its own (their tokens_per_s too), two steps follow
    assert len(after) == step + 2 and after[:step] == before, (before, after)


def test_cli_bad_config_exits_2(tmp_path):
    proc = forkrun.run([sys.executable, str(ROOT / "recipes" / "sft_llama13b.py"), "--model", str(tmp_path),
                        "--data", "x.json", "--set", "optim.no_such_field=1"])
    assert proc.returncode == 2
    assert "unknown config field 'optim.no_such_field'" in proc.stderr


def test_train_from_converted_shards_matches_hf_start(tmp_path):
    """Starting from convert_hf_to_mp.py output is the same run as starting from the HF folder."""
    from hfmeg.checkpoint.convert import hf_to_mp

    model = _assets()
    mp = hf_to_mp(model, tmp_path / "mp", tp=2, pp=2)
    spawn(_run, 4, _config(tmp_path / "from_hf", model, tp=2, pp=2, steps=3))
    spawn(_run, 4, _config(tmp_path / "from_mp", mp, tp=2, pp=2, steps=3))
    assert _losses(tmp_path / "from_mp") == _losses(tmp_path / "from_hf")


class _FakeHfApi:
    """Records the Hub calls (in a file: they happen in a forked rank) instead of making them."""

    log: Path

    def create_repo(self, **kwargs):
        with self.log.open("a") as f:
            f.write(json.dumps({"call": "create_repo", **kwargs}) + "\n")

    def upload_folder(self, **kwargs):
        files = sorted(p.name for p in Path(kwargs["folder_path"]).iterdir())
        with self.log.open("a") as f:
            f.write(json.dumps({"call": "upload_folder", "files": files, **kwargs}) + "\n")
        return "https://huggingface.co/me/tiny/commit/0"


def test_push_to_hub_uploads_the_export(tmp_path, monkeypatch):
    import hfmeg.hub

    model = _assets()
    _FakeHfApi.log = tmp_path / "calls.jsonl"
    monkeypatch.setattr(hfmeg.hub, "HfApi", _FakeHfApi)
    monkeypatch.setenv("HF_TOKEN", "hf_do_not_leak_0123456789")
    cfg = _config(tmp_path / "run", model, steps=2)
    cfg.hub.push_to_hub, cfg.hub.private = "me/tiny", True
    hf, _ = spawn(_run, 1, cfg)[0]
    calls = [json.loads(line) for line in _FakeHfApi.log.read_text().splitlines()]
    assert calls[0] == {"call": "create_repo", "repo_id": "me/tiny", "repo_type": "model", "private": True,
                        "exist_ok": True}
    assert calls[1]["call"] == "upload_folder" and calls[1]["repo_id"] == "me/tiny"
    assert Path(calls[1]["folder_path"]) == Path(hf)
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(
        calls[1]["files"])
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            assert b"hf_do_not_leak" not in path.read_bytes(), path


def test_pretrain_recipe_on_text(tmp_path):
    """recipes/pretrain_llama.py: plain-text stream, every token trained on, split long documents."""
    model = _assets()
    c4 = ASSETS / "data" / "c4_demo.jsonl"
    out = tmp_path / "run"
    proc = forkrun.run([sys.executable, str(ROOT / "recipes" / "pretrain_llama.py"), "--model", str(model),
                        "--data", str(c4), "--tp", "1", "--seq-len", "128", "--global-batch-size", "4", "--max-steps", "3",
                        "--out", str(out), "--report-to", "none", "--set", "data.eval_split=0"],
                       timeout=300)  # the density check is on the first records
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    # Text: every position has a target except each document's last token (nothing follows it).
    assert len(rows) == 3 and 0.95 * 4 * 128 < rows[0]["tokens"] < 4 * 128
    assert yaml.safe_load((out / "config.yaml").read_text())["data"]["format"] == "text"
    # plain text trains with no chat template, so the export records none (and its card says so)
    assert "chat_template" not in json.loads((out / "hf" / "tokenizer_config.json").read_text())
    assert "- prompt format: plain text, no chat template" in (out / "hf" / "README.md").read_text()
