"""Damaged LoRA checkpoints, like the full checkpoints of test_checkpoint_recovery.py: a missing rank shard, a
truncated one, an extra rank folder and a shard of another TP size, each through the trainer's resume at TP2 on
2 gloo ranks, `convert_mp_to_hf.py` (with and without `--merge`) and `reshard_mp.py`: one line naming the
file, exit 2 (the same agreed error on every rank), nothing written, no traceback. Also what a LoRA run writes
(0644 files, 0755 folders), a changed `--peft` at resume, the export pair all-or-nothing, stale export
folders removed at start, and an empty trainer state under torchrun: every rank exits 2 itself.

One small LoRA checkpoint (stories260K, TP2, 2 steps) per module; each case damages a copy of it.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from test_checkpoint_recovery import _args
from test_peft_train import _config
from tool_loader import load_tool

import hfmeg.peft.export as export_module
from hfmeg.errors import CheckpointError, HfmegError
from hfmeg.parallel.launch import free_port, spawn
from hfmeg.peft.config import PeftConfig
from hfmeg.peft.export import export_checkpoint
from hfmeg.train.checkpointing import STATE_FILE, RunCheckpoints
from hfmeg.train.parts.adapters import check_resume_settings
from hfmeg.train.trainer import Trainer

ITER = Path("checkpoints/iter_0000002")
SHARD = ITER / "mp_rank_01" / "adapter.safetensors"


def _train(cfg):
    Trainer(cfg).run()


@pytest.fixture(scope="module")
def lora_run(stories_lora, tmp_path_factory):
    """(base, starting adapter, the run's --out, a TP4 reshard of its checkpoint)."""
    base, adapter0 = stories_lora
    root = tmp_path_factory.mktemp("damage")
    out = root / "run"
    spawn(_train, 2, _config(out, base, adapter0, tp=2, steps=2, save_every=2))
    tp4 = root / "tp4"
    assert load_tool("reshard_mp").main(["--mp", str(out / "checkpoints"), "--out", str(tp4), "--tp", "4",
                                         "--pp", "1"]) == 0
    return base, adapter0, out, tp4


def _damage(kind: str, run: Path, tp4: Path, to: Path) -> tuple[Path, str]:
    """A copy of `run` at `to` with its checkpoint damaged; (the path the error must name, what it says)."""
    shutil.copytree(run, to)
    shard = to / SHARD
    if kind == "missing":
        shard.unlink()
        return shard, "missing"
    if kind == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
        return shard, "cannot read the adapter shard, truncated"
    if kind == "extra_rank":  # a TP4 save's mp_rank_02 beside the TP2 ones
        shutil.copytree(tp4 / "iter_0000002" / "mp_rank_02", to / ITER / "mp_rank_02")
        return to / ITER / "mp_rank_02", "a rank folder the layout does not have"
    shutil.copyfile(tp4 / "iter_0000002" / "mp_rank_01" / "adapter.safetensors", shard)  # tp4: a TP4 rank's shard
    return shard, "the layout implies"


KINDS = ["missing", "truncated", "extra_rank", "tp4"]


def test_every_file_a_lora_run_writes_has_the_umask_mode(lora_run):
    """Checkpoints (adapter and optimizer shards, RNG, state), adapter/, hf/ (merged), metrics, copies of the
    base's read-only side files: 0644 files and 0755 folders under umask 022."""
    out = lora_run[2]
    umask = os.umask(0)
    os.umask(umask)
    paths = [out, *out.rglob("*")]
    assert {p.relative_to(out).parts[0] for p in paths[1:]} >= {"checkpoints", "adapter", "hf", "metrics.jsonl"}
    wrong = [(str(p), oct(stat.S_IMODE(p.stat().st_mode))) for p in paths
             if stat.S_IMODE(p.stat().st_mode) != (0o777 if p.is_dir() else 0o666) & ~umask]
    assert not wrong


@pytest.mark.parametrize("kind", KINDS)
def test_converters_refuse_a_damaged_adapter_checkpoint_in_one_line(kind, lora_run, tmp_path, capsys):
    base, _, run, tp4 = lora_run
    named, what = _damage(kind, run, tp4, tmp_path / "run")
    mp = str(tmp_path / "run" / "checkpoints")
    outs = tmp_path / "outputs"
    calls = [("convert_mp_to_hf", ["--mp", mp, "--out", str(outs / "a")]),
             ("convert_mp_to_hf", ["--mp", mp, "--out", str(outs / "b" / "adapter"), "--merge", str(outs / "b" / "hf")]),
             ("reshard_mp", ["--mp", mp, "--out", str(outs / "c"), "--tp", "1", "--pp", "1"])]
    for tool, argv in calls:
        code = load_tool(tool).main(argv)
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {named}: ") and what in err[0], \
            (tool, argv, err)
        assert "Traceback" not in captured.out + captured.err
        assert not outs.exists(), sorted(outs.rglob("*"))  # no output, no temporary folder, no parent made


def _resume(cfg):
    try:
        Trainer(cfg)
    except HfmegError as e:
        return type(e).__name__, str(e), e.agreed
    return None


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("kind", KINDS)
def test_resume_refuses_a_damaged_adapter_checkpoint_on_every_rank(kind, lora_run, tmp_path):
    base, adapter0, run, tp4 = lora_run
    out = tmp_path / "run"
    named, what = _damage(kind, run, tp4, out)
    before = _files(out)
    errors = spawn(_resume, 2, _config(out, base, adapter0, tp=2, steps=4, save_every=2, resume="auto"))
    assert errors[0] == errors[1], errors  # one agreed error: rank 1 read the damaged shard, rank 0 says it
    name, line, agreed = errors[0]
    assert name == "CheckpointError" and agreed and line.startswith(f"{named}: ") and what in line, line
    assert "\n" not in line and _files(out) == before  # nothing written (the run's lock is released)


def test_a_changed_peft_method_or_setting_is_named_at_resume(lora_run, tmp_path):
    base, adapter0, run, _ = lora_run
    cfg = _config(run, base, adapter0, tp=2, steps=4, resume="auto")
    full = spawn(_resume, 2, replace(cfg, peft=PeftConfig(method="none")))
    assert full[0] == full[1] and full[0][1].startswith(f"peft.method: {run / ITER} was saved by a lora run"), full
    fake = tmp_path / "iter_0000002"  # a full fine-tune's checkpoint holds no adapter.json
    fake.mkdir()
    with pytest.raises(CheckpointError, match=f"^peft.method: {fake} was saved by a full fine-tune"):
        check_resume_settings(fake, PeftConfig(method="lora"))
    saved = export_module.read_info(run / ITER)[0]
    with pytest.raises(CheckpointError, match=r"^peft.r: .*adapter.json was saved with 4, this run has 8"):
        check_resume_settings(run / ITER, replace(saved, r=8))
    check_resume_settings(run / ITER, replace(saved, dropout=0.1))  # dropout may change


@pytest.mark.parametrize("step", ["write_peft_folder", "merge_into_hf"])
def test_the_adapter_and_merged_folders_are_written_together_or_not_at_all(step, lora_run, tmp_path, monkeypatch):
    """Either write fails right after it has written its folder: neither folder is left."""
    run, real = lora_run[2], getattr(export_module, step)

    def fails_after(*args, **kwargs):
        real(*args, **kwargs)
        raise CheckpointError("disk full (injected)")

    monkeypatch.setattr(export_module, step, fails_after)
    with pytest.raises(CheckpointError, match="injected"):
        export_checkpoint(run / ITER, tmp_path / "x" / "adapter", merged=tmp_path / "x" / "hf")
    assert not (tmp_path / "x").exists()


def test_start_up_removes_what_a_killed_export_left(tmp_path):
    out = tmp_path / "run"
    left = [out / ".adapter.tmp-4242", out / "..adapter.tmp-4242.tmp-4242", out / ".hf.tmp-4242",
            out / ".adapter.old-4242"]
    for folder in left:
        folder.mkdir(parents=True)
        (folder / "adapter_model.safetensors").write_bytes(b"half")
    (out / "keep.txt").write_text("mine")
    removed = RunCheckpoints(out, keep_last=2, resume="auto").remove_stale()
    assert sorted(removed) == sorted(left) and [p.name for p in out.iterdir()] == ["keep.txt"]


def test_an_empty_trainer_state_under_torchrun_makes_every_rank_exit_2(lora_run, tmp_path):
    """Every rank finds it; rank 0 says it; torchrun's SIGTERM (sent when the first worker exits) kills none."""
    base, adapter0, run, _ = lora_run
    out = tmp_path / "run"
    shutil.copytree(run, out)
    (out / ITER / STATE_FILE).write_text("{}")
    env = {**os.environ, "HFMEG_BACKEND": "gloo", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           *_args(base, out, 4), "--peft", "lora"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {out / ITER / STATE_FILE}: field step is missing; resume from an earlier checkpoint "
                      "with --resume PATH"], proc.stderr[-3000:]
    assert proc.stderr.count("exitcode  : 2") == 2 and "SIGTERM" not in proc.stderr.split("Failures:")[-1], \
        proc.stderr[-3000:]


def test_a_truncated_peft_adapter_is_one_line_on_import(lora_run, tmp_path, capsys):
    base, adapter0, _, _ = lora_run
    adapter = tmp_path / "adapter"
    shutil.copytree(adapter0, adapter)
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    code = load_tool("convert_hf_to_mp").main(["--hf", str(base), "--out", str(tmp_path / "x"), "--tp", "2",
                                               "--pp", "1", "--adapter", str(adapter)])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 2 and err == [f"error: {weights}: cannot read the adapter weights, truncated or not safetensors "
                                 "(SafetensorError: Error while deserializing header: incomplete metadata, file not "
                                 "fully covered)"], err
    assert "Traceback" not in captured.out + captured.err and not (tmp_path / "x").exists()
