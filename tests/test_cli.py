"""The `hfmeg` console command: its subcommands and their help, `python -m hfmeg`, `hfmeg convert` both ways
bit-exact, `hfmeg train --print-config` and a run's OUT/config.yaml, `hfmeg export` as the trainer exports.

Commands run in-process through `hfmeg.commands.main.main` (what the console script calls), except one
`python -m hfmeg --help` subprocess.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from convert_helpers import assert_same_tensors, snapshot
from hfmeg.commands.main import COMMANDS, main as hfmeg
from hfmeg.checkpoint.mp_layout import MPLayout
from hfmeg.parallel.launch import spawn
from hfmeg.peft.adapter_files import WEIGHTS_FILE
from hfmeg.train.cli import RECIPE_DIR, RECIPES
from hfmeg.train.config import TrainConfig
from hfmeg.train.dataclass_io import build
from hfmeg.train.run_lock import LOCK_FILE, RunLock
from peft_helpers import make_base_and_adapter
from recipe_models import RECIPE_MODELS
from test_peft_train import _config as lora_config
from test_train import ALPACA, _assets, _config, _losses, _run
from tiny_models import save_tiny

# Every parser a user can reach, by the argv that reaches it.
PARSERS = [[name] for name in COMMANDS] + [["convert", "to-mp"], ["convert", "to-hf"], ["plan", "calibrate"],
                                           ["plan", "scaling"], ["plan", "published"]]


def test_python_m_hfmeg_help_lists_every_command():
    proc = subprocess.run([sys.executable, "-m", "hfmeg", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: hfmeg ")
    listed = re.findall(r"^ {4}(\S+) ", proc.stdout, re.M)  # "    train     train a model: ..."
    assert listed == list(COMMANDS) == ["train", "convert", "reshard", "verify", "export", "chat", "launch", "plan"], proc.stdout


@pytest.mark.parametrize("argv", PARSERS, ids=" ".join)
def test_every_subcommand_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        hfmeg([*argv, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"usage: hfmeg {' '.join(argv)} "), out[:200]


def _parser_of(argv: list[str], monkeypatch) -> argparse.ArgumentParser:
    """The parser `hfmeg argv ...` parses its arguments with (stopped before it does anything)."""
    seen = []

    class Parsed(Exception):
        pass

    def capture(self, args=None, namespace=None):
        seen.append(self)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(Parsed):
        hfmeg(argv)
    return seen[0]


def _actions(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _actions(sub)
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield parser.prog, action


@pytest.mark.parametrize("argv", [a for a in PARSERS if len(a) == 1] + [["plan", "calibrate"], ["plan", "scaling"],
                                                                        ["plan", "published"]], ids=" ".join)
def test_every_flag_has_a_help_text(argv, monkeypatch):
    missing = [f"{prog} {'/'.join(a.option_strings) or a.dest}" for prog, a in _actions(_parser_of(argv, monkeypatch))
               if not a.help]
    assert not missing, missing


@pytest.mark.parametrize("argv", [[], ["bogus"], ["--tp", "2"]])
def test_no_or_an_unknown_command_is_exit_2_with_the_usage(argv, capsys):
    with pytest.raises(SystemExit) as e:
        hfmeg(argv)
    assert e.value.code == 2 and "usage: hfmeg " in capsys.readouterr().err


def test_convert_round_trip_bit_exact(tmp_path, capsys):
    src = save_tiny("llama3", tmp_path / "src", num_hidden_layers=4)
    mp, back = tmp_path / "mp", tmp_path / "back"
    assert hfmeg(["convert", "to-mp", "--hf", str(src), "--out", str(mp), "--tp", "2", "--pp", "2"]) == 0
    assert (MPLayout.read(mp / "release").tp, MPLayout.read(mp / "release").pp) == (2, 2)
    assert hfmeg(["convert", "to-hf", "--mp", str(mp), "--out", str(back)]) == 0
    assert assert_same_tensors(src, back) > 0
    # to-mp checked its first layers against transformers by default (`checkpoint.parity.check_prefix`)
    assert [line.split(":")[0] for line in capsys.readouterr().out.splitlines()] == ["verified", f"wrote {mp}",
                                                                                     f"wrote {back}"]
    # Bad input: one line, exit 2, nothing written.
    assert hfmeg(["convert", "to-hf", "--mp", str(src), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {src}") and not (tmp_path / "x").exists(), err


def test_convert_catches_a_wrong_rule_by_default(tmp_path, capsys, monkeypatch):
    """A rule that fuses up before gate (shapes right, rows wrong) converts, and the check after it fails in one line
    with exit 2; `--no-verify` skips the check, so that same wrong conversion passes."""
    from dataclasses import replace

    from hfmeg.checkpoint import rules

    src = save_tiny("llama3", tmp_path / "src", num_hidden_layers=4)
    spec_of = rules.spec_of

    def swapped(cfg):
        spec = spec_of(cfg)
        def layer_rules(cfg, i, experts):
            return [replace(r, hf=r.hf[::-1]) if r.local.endswith("mlp.fc1.weight") else r
                    for r in spec.layer_rules(cfg, i, experts)]
        return replace(spec, layer_rules=layer_rules)

    monkeypatch.setattr(rules, "spec_of", swapped)
    argv = ["convert", "to-mp", "--hf", str(src), "--out", str(tmp_path / "mp"), "--tp", "2", "--pp", "2"]
    capsys.readouterr()  # the tiny model's save
    assert hfmeg(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "first 2 layers' logits differ from transformers'" in err[0], err
    assert hfmeg(argv + ["--overwrite", "--no-verify"]) == 0


def test_convert_an_adapter_both_ways_bit_exact(tmp_path):
    base, adapter = make_base_and_adapter(tmp_path, "llama3")
    shards, back = tmp_path / "shards", tmp_path / "back"
    assert hfmeg(["convert", "to-mp", "--hf", str(base), "--out", str(shards), "--tp", "2", "--pp", "1",
                  "--adapter", str(adapter)]) == 0
    assert hfmeg(["convert", "to-hf", "--mp", str(shards), "--out", str(back)]) == 0
    want, got = load_file(str(adapter / WEIGHTS_FILE)), load_file(str(back / WEIGHTS_FILE))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def _train_argv(tmp_path, *extra: str) -> list[str]:
    return ["train", "--recipe", "sft_llama13b", "--model", str(tmp_path / "model"), "--data", str(ALPACA),
            "--tp", "1", "--global-batch-size", "4", "--max-steps", "7", "--out", str(tmp_path / "run"), *extra]


def test_print_config_prints_yaml_that_reads_back_to_the_same_config(tmp_path, capsys, monkeypatch):
    printed_argv = _train_argv(tmp_path, "--lr", "3e-3", "--set", "optim.weight_decay=0.02", "--print-config")
    assert hfmeg(printed_argv) == 0
    printed = capsys.readouterr().out
    data = yaml.safe_load(printed)
    cfg = build(TrainConfig, data)
    assert cfg.to_dict() == data
    assert (cfg.parallel.tp, cfg.train.max_steps, cfg.optim.lr, cfg.optim.weight_decay) == (1, 7, 3e-3, 0.02)
    assert cfg.model.recompute == "selective"  # from the recipe's YAML
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written
    # The printed YAML is a config: given as CONFIG, it prints itself again.
    (tmp_path / "run.yaml").write_text(printed)
    assert hfmeg(["train", str(tmp_path / "run.yaml"), "--print-config"]) == 0
    assert capsys.readouterr().out == printed
    # A bad setting is refused by the same validation, in one line.
    assert hfmeg(_train_argv(tmp_path, "--tp", "3", "--print-config")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: parallel."), err
    # Every built-in recipe is shipped and valid at the world size it is laid out for (16: the others').
    for name in RECIPES:
        monkeypatch.setenv("WORLD_SIZE", str(RECIPE_MODELS.get(name, (None, 16))[1]))
        assert hfmeg(["train", "--recipe", name, "--model", "m", "--data", "d", "--print-config"]) == 0, name
        recipe = yaml.safe_load((RECIPE_DIR / f"{name}.yaml").read_text())
        assert yaml.safe_load(capsys.readouterr().out)["parallel"]["tp"] == recipe["parallel"]["tp"]


def test_train_without_a_config_says_what_to_pass(capsys):
    assert hfmeg(["train", "--model", "m", "--data", "d"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: no config: pass a YAML file (hfmeg train CONFIG) or a built-in recipe (--recipe " \
                  f"{'|'.join(RECIPES)})"


def _trained_run(tmp_path, lora=None):
    """A 2-step run on stories260K saving every step (iter 1 and 2), exported by the trainer at its end; with
    `lora` (base, adapter): a LoRA run."""
    out = tmp_path / "run"
    cfg = lora_config(out, *lora, steps=2, save_every=1) if lora else _config(out, _assets(), steps=2, save_every=1,
                                                                               gbs=4)
    spawn(_run, 1, cfg)
    return out


@pytest.mark.parametrize("method", ["full", "lora"])
def test_export_a_run_as_the_trainer_does(method, tmp_path, capsys, request):
    exported = ["hf", "adapter"] if method == "lora" else ["hf"]
    out = _trained_run(tmp_path, request.getfixturevalue("stories_lora") if method == "lora" else None)
    by_trainer = {name: snapshot(out / name) for name in exported}
    assert all("README.md" in files for files in by_trainer.values()) and (out / "adapter").exists() == (method == "lora")
    record = (out / "export.json").read_text()
    for name in exported:
        shutil.rmtree(out / name)
    (out / "export.json").unlink()
    capsys.readouterr()
    assert hfmeg(["export", str(out)]) == 0
    log = capsys.readouterr().out
    assert f"exporting {out / 'checkpoints' / 'iter_0000002'}: step 2 of 2\n" in log and f"wrote {out / 'hf'}:" in log
    # weights, tokenizer, config and model card alike
    assert {name: snapshot(out / name) for name in exported} == by_trainer
    assert (out / "export.json").read_text() == record
    if method == "lora":
        return
    # An earlier checkpoint (an interrupted run's last) exports with the metrics logged up to its step.
    assert hfmeg(["export", str(out / "checkpoints" / "iter_0000001")]) == 0
    assert f"exporting {out / 'checkpoints' / 'iter_0000001'}: step 1 of 2\n" in capsys.readouterr().out
    assert json.loads((out / "export.json").read_text()) == {"step": 1, "pushed_to": None}
    losses = _losses(out)
    card = (out / "hf" / "README.md").read_text()
    assert f"{losses[0]:.6g}" in card and f"{losses[1]:.6g}" not in card, card


def test_export_refusals_are_one_line(tmp_path, capsys):
    out = _trained_run(tmp_path)
    lone = tmp_path / "lone"
    shutil.copytree(out / "checkpoints" / "iter_0000002", lone)
    other = tmp_path / "other"  # a run whose checkpoint records a config this hfmeg does not know
    shutil.copytree(out, other)
    state_file = other / "checkpoints" / "iter_0000002" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["config"]["optim"]["no_such_field"] = 1
    state_file.write_text(json.dumps(state))
    before = {k: v for k, v in snapshot(out).items() if k != LOCK_FILE}
    lock = RunLock(out)
    lock.acquire()  # a live run on OUT
    try:
        cases = [(["export", str(out)], "already in use by another run"),
                 (["export", str(lone)], "not a checkpoint of a training run"),
                 (["export", str(out), "--iteration", "9"], "iteration folder iter_0000009 does not exist"),
                 (["export", str(out), "--push-to-hub", "not a repo id"], "is not a valid Hub repo id"),
                 (["export", str(other)], f"{state_file}: field config: ")]
        for argv, expect in cases:
            assert hfmeg(argv) == 2, argv
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and expect in err[0], (argv, err)
    finally:
        lock.release()
    assert {k: v for k, v in snapshot(out).items() if k != LOCK_FILE} == before  # nothing written
