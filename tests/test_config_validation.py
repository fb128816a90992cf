"""Start-up validation (issue 18 #2, #6, #12): every bad setting is one line and exit 2 before any work.

The recipe command line runs in-process through `hfmeg.train.cli.main` (the recipes'
own entry point), except for the one torchrun test, which checks what the launcher
does with the workers' exit code 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hfmeg.train import cli
from hfmeg.train.validate import load_config
from hfmeg.train.dataclass_io import ConfigError
from hfmeg.train.validate import check_hub_login

ROOT = Path(__file__).resolve().parents[1]
SFT = cli.recipe_config("sft_llama13b")
PRETRAIN = cli.recipe_config("pretrain_llama")
MIXTRAL = cli.recipe_config("sft_mixtral")
BASE = ["--model", "no/model", "--data", "no-data.json", "--tp", "1", "--out", "never-written"]


@pytest.fixture(autouse=True)
def _one_process_no_token(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no cached login either
    monkeypatch.chdir(tmp_path)


def _refused(capsys, argv: list[str], expect: str) -> None:
    assert cli.main("test", SFT, BASE + argv) == 2
    out, err = capsys.readouterr()
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert lines == [f"error: {expect}"] or (len(lines) == 1 and expect in lines[0]), out + err
    assert not Path("never-written").exists()


@pytest.mark.parametrize("argv, expect", [
    (["--lr", "-1e-3"], "optim.lr: must be a finite number > 0, got -0.001"),  # was parsed as a flag
    (["--lr=0"], "optim.lr: must be a finite number > 0, got 0"),
    (["--keep-last", "0"], "checkpoint.keep_last: must be >= 1, got 0"),
    (["--set", "model.vocab_multiple=0"], "model.vocab_multiple: must be >= 1, got 0"),  # was ZeroDivisionError
    (["--max-steps", "-5"], "train.max_steps: must be >= 1, got -5"),
    (["--seq-len", "1"], "data.seq_len must be >= 2, got 1"),
    (["--save-every", "-1"], "checkpoint.save_every: must be >= 0, got -1"),
    (["--seed", "-1"], "train.seed: must be >= 0, got -1"),
    (["--set", "train.collective_timeout_s=0"], "train.collective_timeout_s: must be a finite number > 0, got 0"),
    (["--set", "train.heartbeat_timeout_s=-1"], "train.heartbeat_timeout_s: must be >= 0, got -1"),
    (["--warmup-steps", "-2"], "lr schedule fields warmup_steps >= 0"),  # checked by LRScheduleConfig itself
    (["--set", "optim.beta2=1.0"], "optim.beta2: must be in [0, 1), got 1"),
    (["--global-batch-size", "7", "--micro-batch-size", "2"],
     "train.global_batch_size: global batch 7 is not divisible by DP x micro-batch = 1 x 2"),
    (["--tp", "2"], "parallel.tp x parallel.cp x parallel.pp: world size 1 is not a multiple of TP x CP x PP = 2 x 1 x 1"),
    (["--cp", "0"], "parallel.cp: must be >= 1, got 0"),
    (["--ep", "2"], "parallel.ep: EP=2 does not divide DP=1 (expert-parallel ranks are data-parallel ranks)"),
    (["--resume", "no/such/checkpoint"], "checkpoint.resume: 'no/such/checkpoint' is neither none, auto nor"),
    (["--set", "data.eval_split=0"], "train.eval_every: 100 asks for evaluation but there is no eval data"),
    (["--push-to-hub", "bad//id"], "hub.push_to_hub: 'bad//id' is not a valid Hub repo id"),
    (["--push-to-hub", "me/tiny"], "hub.push_to_hub: no Hugging Face token found"),
    (["--layout", "sideways"], "parallel.layout: 'sideways' is not one of ['manual', 'auto']"),
    (["--layout", "auto"],  # BASE's --tp 1: the planner chooses tp, so a typed one contradicts it
     "parallel.tp: set on the command line, but parallel.layout auto chooses it; drop it or use --layout manual"),
    (["--layout", "auto", "--set", "parallel.pp_layers=1,1"],
     "parallel.pp_layers: a layer split fits one pp x vpp, and parallel.layout auto chooses those"),
    (["--layout", "auto", "--set", "parallel.plan_profile=no-profile.json"],
     "parallel.plan_profile: no-profile.json is not a file (write one with `hfmeg plan calibrate --out FILE`)"),
    (["--set", "parallel.plan_profile=no-profile.json"],
     "parallel.plan_profile: only parallel.layout auto plans with a profile; drop it or use --layout auto"),
    (["--set", "model.fp8=fp4"], "model.fp8: 'fp4' is not one of ['off', 'tensorwise', 'rowwise', 'rowwise_with_gw_hp']"),
    (["--set", "model.fp8_exclude=layers.0.*"], "model.fp8_exclude: only read with model.fp8 set to a recipe"),
    (["--set", "model.fp8=tensorwise", "--peft", "qlora"],
     "model.fp8: tensorwise does not combine with a 4-bit base (peft.quantize: nf4)"),
])
def test_bad_settings_are_one_line_and_exit_2(capsys, argv, expect):
    _refused(capsys, argv, expect)


def test_an_expert_parallel_size_the_model_cannot_take_exits_2(capsys, monkeypatch, tmp_path):
    """EP must divide the expert count (read from the model's config.json before any process group)."""
    from tiny_models import save_tiny

    mixtral = save_tiny("mixtral", tmp_path / "mixtral")  # 4 experts
    capsys.readouterr()
    monkeypatch.setenv("WORLD_SIZE", "3")
    _refused(capsys, ["--model", str(mixtral), "--ep", "3", "--global-batch-size", "3", "--set", "model.compile=false"],
             "config.json field num_local_experts: 4 experts cannot be split evenly over parallel.ep=3")


@pytest.mark.parametrize("argv, expect", [
    (["--seq-len", "30"], "data.seq_len: sequence length 30 does not split into 2 x CP = 4 equal chunks; use a multiple of 4"),
    (["--tp", "4", "--seq-len", "36", "--sequence-parallel"],
     "data.seq_len: the 18 tokens of each CP rank (sequence length 36 / CP=2) do not divide over TP=4"),
])
def test_a_sequence_context_parallelism_cannot_split_exits_2(capsys, monkeypatch, argv, expect):
    monkeypatch.setenv("WORLD_SIZE", "8")
    _refused(capsys, ["--cp", "2", "--global-batch-size", "8"] + argv, expect)


def test_context_parallelism_with_the_routers_loss_exits_2(capsys, monkeypatch, tmp_path):
    """The MoE load-balancing loss is a mean over a forward's tokens, which a CP rank sees a part of."""
    from tiny_models import save_tiny

    mixtral = save_tiny("mixtral", tmp_path / "mixtral")  # output_router_logits true
    capsys.readouterr()
    monkeypatch.setenv("WORLD_SIZE", "2")
    _refused(capsys, ["--model", str(mixtral), "--cp", "2", "--seq-len", "64", "--set", "model.compile=false"],
             "config.json field output_router_logits: the router's load-balancing loss is not supported with "
             "parallel.cp=2")


def test_only_rank_0_prints_but_every_rank_exits_2(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert cli.main("test", SFT, BASE + ["--lr", "-1"]) == 2
    out, err = capsys.readouterr()
    assert out + err == ""


def test_the_recipes_defaults_evaluate_on_held_out_data():
    """The recipes evaluate every 100/200 steps: they must bring eval data (they crashed at that step)."""
    for yaml, world in ((SFT, 8), (PRETRAIN, 8), (MIXTRAL, 16)):
        cfg, warnings = load_config(yaml, {"model.path": "m", "data.sources": [{"path": "d.json"}]}, world_size=world)
        assert 0 < cfg.train.eval_every <= cfg.train.max_steps and cfg.data.eval_split > 0
        assert warnings == []


def test_layout_auto_replaces_the_yamls_layout_but_refuses_a_shard_folder(capsys):
    """The recipe's tp 4 on one process is no error with auto (the trainer replaces it); shards fix their layout."""
    cfg, _ = load_config(SFT, {"model.path": "m", "data.sources": [{"path": "d.json"}], "parallel.layout": "auto"},
                         world_size=1)
    assert (cfg.parallel.layout, cfg.parallel.tp) == ("auto", 4)
    Path("shards").mkdir()
    Path("shards/hfmeg_layout.json").write_text("{}")
    _refused(capsys, ["--layout", "auto", "--model", "shards"],
             "model.path: shards is an hfmeg shard folder, cut for one layout, and parallel.layout auto chooses")


def test_warm_up_as_long_as_the_run_is_a_warning():
    cfg, warnings = load_config(SFT, {"model.path": "m", "data.sources": [{"path": "d.json"}], "train.max_steps": 30,
                                      "parallel.tp": 1})
    assert warnings == ["warning: lr.warmup_steps 30 >= train.max_steps 30: the learning rate never reaches "
                        "optim.lr 2e-05"]


def test_powersgd_without_data_parallel_ranks_is_a_warning():
    base = {"model.path": "m", "data.sources": [{"path": "d.json"}], "optim.compression": "powersgd",
            "parallel.tp": 2, "parallel.pp": 2}
    _, warnings = load_config(SFT, base, world_size=4)
    assert warnings == ["warning: optim.compression: powersgd compresses the data-parallel gradient reduction, and "
                        "parallel.tp x parallel.pp = 4 processes leave one data-parallel rank: it does nothing here"]
    assert load_config(SFT, base, world_size=8)[1] == []  # DP 2: something to compress


def test_hub_login_check_rejects_a_bad_token_and_skips_when_unreachable(monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError

    class Response:
        status_code, headers, request = 401, {}, None

    class Api:
        def whoami(self):
            raise HfHubHTTPError("401", response=Response())

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    with pytest.raises(ConfigError, match="the Hub rejected the Hugging Face token"):
        check_hub_login("me/tiny")
    Api.whoami = lambda self: {"name": "me", "orgs": [{"name": "team"}]}
    assert check_hub_login("team/tiny") == "push to hub: team/tiny as me"
    with pytest.raises(ConfigError, match="belongs to 'me', which cannot create repos under 'other'"):
        check_hub_login("other/tiny")

    def hang(self):
        import time
        time.sleep(30)

    Api.whoami = hang
    line = check_hub_login("me/tiny", timeout=0.2)
    assert "could not reach the Hub to check the token (no answer in 0.2 s)" in line


def test_under_torchrun_a_config_error_is_one_line_and_workers_exit_2(tmp_path):
    """torchrun's elastic agent turns any failed worker into its own exit 1 plus a ChildFailedError report;
    what hfmeg controls is that the error is printed once and the workers exit 2."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this interpreter")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # --standalone: a free rendezvous port, not torchrun's default 29500 (another suite on the host may hold it)
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", str(ROOT / "recipes" / "sft_llama13b.py"), *BASE,
                           "--lr", "-1e-3"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180)
    text = proc.stdout + proc.stderr
    assert [line for line in text.splitlines() if line.startswith("error:")] == [
        "error: optim.lr: must be a finite number > 0, got -0.001"], text
    # The root cause is a worker's exit 2 (the agent may SIGTERM the other worker before it exits on its own).
    assert "exitcode  : 2" in text.split("Root Cause")[1], text
    assert proc.returncode == 1  # torch.distributed.run: ChildFailedError, whatever the workers' code


def test_read_only_out_is_refused_at_start(capsys, monkeypatch, tmp_path):
    import hfmeg.train.validate as validate

    monkeypatch.setattr(validate.os, "access", lambda path, mode: Path(path) != tmp_path)
    _refused(capsys, ["--out", str(tmp_path / "run")],
             f"checkpoint.out: {tmp_path} is not writable (read-only storage or no permission)")


def test_a_full_disk_during_training_is_one_line(capsys, monkeypatch):
    """A write no deeper layer turned into a CheckpointError (e.g. a side file of a checkpoint)."""
    import errno

    import hfmeg.train.trainer as trainer

    class FullDisk:
        def __init__(self, cfg):
            raise OSError(errno.ENOSPC, "No space left on device", "run/checkpoints/.iter_0000010.tmp/rng/r.json")

    monkeypatch.setattr(cli, "fit_to_model", lambda cfg: None)
    monkeypatch.setattr(trainer, "Trainer", FullDisk)
    assert cli.main("test", SFT, BASE) == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines()[-1] == ("error: run/checkpoints/.iter_0000010.tmp/rng/r.json: "
                                            "No space left on device")
