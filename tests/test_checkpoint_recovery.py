"""No path loses a checkpoint or the final model: a missing `latest`, a run that died in its export,
damaged shards, a full disk, stale temporary folders, and metrics after a resume.

Runs fine-tune stories260K on alpaca_en_demo.json with 64-token rows (seconds each). The error
paths run the recipe as one job's worker processes (no launcher in between, so each worker's exit
code and the combined output of all ranks are what the test reads), forked from the test process
(tests/forkrun.py: the job's rendezvous in each one's environment, as a launcher would give it).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import forkrun
import pytest
from transformers import AutoModelForCausalLM

import hfmeg.train.parts.full as full_part  # its mp_to_hf writes a full run's export
from hfmeg.errors import CheckpointError
from hfmeg.parallel.launch import free_port, spawn, start_method
from hfmeg.train.checkpointing import STATE_FILE, find_resume, incomplete
from hfmeg.train.metrics import read_metrics
from hfmeg.train.trainer import EXPORT_RECORD, Trainer
from test_train import ALPACA, ROOT, _assets, _config
from tiny_models import save_tiny

RECIPE = ROOT / "recipes" / "sft_llama13b.py"


def _run(cfg):
    r = Trainer(cfg).run()
    return r.hf_folder


def _iters(out: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("iter_*"))


def _steps(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def _fake_checkpoint(folder: Path, complete: bool = True) -> Path:
    folder.mkdir(parents=True)
    (folder / "hfmeg_layout.json").write_text("{}")
    (folder / "optim").mkdir()
    (folder / "optim" / "optim_pp000_tp00_dp000.safetensors").write_text("")
    if complete:
        (folder / STATE_FILE).write_text("{}")
    return folder


@pytest.mark.parametrize("latest", [None, "", "garbage\n", "9\n", "5\n"])
def test_resume_auto_without_a_readable_latest_takes_the_newest_complete_checkpoint(tmp_path, latest):
    """Missing, empty, garbled, naming a folder that is gone (9) or an incomplete one (5)."""
    root = tmp_path / "checkpoints"
    for n in (2, 4):
        _fake_checkpoint(root / f"iter_{n:07d}")
    _fake_checkpoint(root / "iter_0000005", complete=False)
    if latest is not None:
        (root / "latest_checkpointed_iteration.txt").write_text(latest)
    found = find_resume(root, "auto")
    assert found.folder == root / "iter_0000004" and found.newer == {5: root / "iter_0000005"}
    assert len(found.notes) == 1 and found.notes[0].endswith("resuming from iter_0000004, the newest complete "
                                                             "checkpoint"), found.notes
    assert incomplete(root / "iter_0000005") == f"no {STATE_FILE}"


def test_resume_none_over_checkpoints_needs_overwrite_and_auto_keeps_a_newer_timeline(tmp_path):
    root = tmp_path / "checkpoints"
    for n in (2, 4, 6):
        _fake_checkpoint(root / f"iter_{n:07d}")
    with pytest.raises(CheckpointError, match=r"holds checkpoints \(iter_0000002, iter_0000004, iter_0000006\) .*"
                                              r"--resume auto .*--overwrite .*another --out"):
        find_resume(root, "none")
    assert find_resume(root, "none", overwrite=True).folder is None
    (root / "latest_checkpointed_iteration.txt").write_text("4\n")  # e.g. a crash before `latest` named 6
    found = find_resume(root, "auto")
    assert found.folder == root / "iter_0000004" and found.newer == {6: root / "iter_0000006"}
    for n in (2, 4, 6):
        shutil.rmtree(root / f"iter_{n:07d}")
    _fake_checkpoint(root / "iter_0000003", complete=False)
    with pytest.raises(CheckpointError, match="no folder in .* is a complete checkpoint"):
        find_resume(root, "auto")


def test_a_lost_latest_deletes_nothing_and_metrics_hold_each_step_once(tmp_path, capfd):
    model = _assets()
    out = tmp_path / "run"
    cfg = _config(out, model, steps=4, save_every=2, resume="auto", schedule_steps=6)
    cfg.checkpoint.keep_last = 3
    spawn(_run, 1, cfg)
    root = out / "checkpoints"
    (root / "latest_checkpointed_iteration.txt").unlink()
    (root / ".iter_0000005.tmp").mkdir()  # a save that died
    cfg.train.max_steps = 6
    spawn(_run, 1, cfg)
    log = capfd.readouterr().out
    assert f"{root}: no latest_checkpointed_iteration.txt: resuming from iter_0000004, the newest complete " \
           "checkpoint" in log
    assert f"removed {root / '.iter_0000005.tmp'}, left half-written by a run that died" in log
    assert _iters(out) == [2, 4, 6] and not (root / ".iter_0000005.tmp").exists()
    assert _steps(out) == [1, 2, 3, 4, 5, 6]
    # A new timeline from step 2, chosen explicitly: steps 3-4 are redone, and logged once.
    cfg.checkpoint.resume, cfg.train.max_steps = str(root / "iter_0000002"), 4
    spawn(_run, 1, cfg)
    assert "iter_0000004, iter_0000006 in" in capfd.readouterr().out
    assert _steps(out) == [1, 2, 3, 4]
    evals_and_steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")]
    assert evals_and_steps == sorted(set(evals_and_steps))


@pytest.mark.skipif(start_method() != "fork", reason="patches the trainer in this process: the ranks must be forked")
def test_a_run_that_died_in_its_export_is_exported_by_the_next(tmp_path, monkeypatch, capfd):
    model = _assets()
    out = tmp_path / "run"
    real = full_part.mp_to_hf

    def dies(checkpoint, hf, **kwargs):
        (out / ".hf.tmp-99999").mkdir()  # what a kill -9 in the middle of the export leaves
        raise RuntimeError("killed in the export")

    cfg = _config(out, model, steps=2, resume="auto")
    monkeypatch.setattr(full_part, "mp_to_hf", dies)
    with pytest.raises(Exception, match="killed in the export"):
        spawn(_run, 1, cfg)
    assert not (out / "hf").exists() and _iters(out) == [2]
    capfd.readouterr()
    monkeypatch.setattr(full_part, "mp_to_hf", real)
    hf = spawn(_run, 1, cfg)[0]
    log = capfd.readouterr().out
    loss = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r][-1]
    assert "run finished: step 2/2, resumed at step 2; 0 steps" in log
    assert f"final train loss {loss:.4f}" in log and f"  model: {out / 'hf'}\n" in log
    assert not (out / ".hf.tmp-99999").exists()
    AutoModelForCausalLM.from_pretrained(hf)
    assert json.loads((out / EXPORT_RECORD).read_text()) == {"step": 2, "pushed_to": None}

    def must_not_export(*args, **kwargs):
        raise AssertionError("exported twice")

    monkeypatch.setattr(full_part, "mp_to_hf", must_not_export)
    spawn(_run, 1, cfg)  # the export is done: a third run says so without redoing it
    assert f"  model: {out / 'hf'}\n" in capfd.readouterr().out


# -- error paths: one line from all ranks together, exit 2 from every worker ------------------------

# Run a recipe with one function of hfmeg replaced on one rank (`FAULT_RANK`): an injected full disk.
_FAULTY = """
import errno, os, runpy, sys
import hfmeg.checkpoint.st_stream as st
if os.environ["RANK"] == os.environ.get("FAULT_RANK"):
    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
    st.StreamingSafetensorsWriter._write_bytes = full
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _workers(args: list[str], world: int, fault_rank: int | None = None) -> tuple[list[int], str]:
    """Run the recipe as `world` worker processes of one job; their exit codes and combined output."""
    port = free_port()
    runs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "HFMEG_BACKEND": "gloo", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        if fault_rank is not None:
            env["FAULT_RANK"] = str(fault_rank)
        runs.append(forkrun.start([sys.executable, "-c", _FAULTY, *args], env=env))
    done = [r.wait(timeout=300) for r in runs]
    return [d.returncode for d in done], "".join(d.stdout + d.stderr for d in done)


def _args(model: Path, out: Path, steps: int) -> list[str]:
    return [str(RECIPE), "--model", str(model), "--data", str(ALPACA), "--tp", "2", "--seq-len", "64",
            "--global-batch-size", "4", "--eval-every", "0", "--max-steps", str(steps), "--save-every", "2",
            "--out", str(out), "--resume", "auto", "--report-to", "none", "--dtype", "fp32"]


def _one_error(codes: list[int], output: str) -> str:
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert codes == [2, 2] and len(errors) == 1 and "Traceback" not in output, (codes, output)
    return errors[0]


def test_damaged_checkpoints_and_a_full_disk_are_one_line_from_all_ranks(tmp_path):
    model = _assets()
    good = tmp_path / "good"
    codes, output = _workers(_args(model, good, 2), 2)
    assert codes == [0, 0], output
    shard = Path("checkpoints/iter_0000002/optim/optim_pp000_tp01_dp000.safetensors")  # rank 1 alone reads it

    def damaged(name: str, damage) -> Path:
        out = tmp_path / name
        shutil.copytree(good, out)
        damage(out)
        return out

    truncated = damaged("truncated", lambda o: (o / shard).write_bytes((o / shard).read_bytes()[:200]))
    assert f"{truncated / shard}: not an hfmeg optimizer shard, or truncated" in _one_error(
        *_workers(_args(model, truncated, 4), 2))
    missing = damaged("missing", lambda o: (o / shard).unlink())
    assert f"{missing / shard.parent}: no optimizer shards for pp rank 0, tp rank 1" in _one_error(
        *_workers(_args(model, missing, 4), 2))
    empty = damaged("empty_state", lambda o: (o / "checkpoints/iter_0000002" / STATE_FILE).write_text("{}"))
    assert f"{empty}/checkpoints/iter_0000002/{STATE_FILE}: field step is missing" in _one_error(
        *_workers(_args(model, empty, 4), 2))
    # A full disk on rank 1 while it writes its model shard at step 4: one line naming the file, the
    # temporary folder removed, the checkpoint of step 2 still the latest.
    full = damaged("full_disk", lambda o: None)
    line = _one_error(*_workers(_args(model, full, 4), 2, fault_rank=1))
    assert f"{full}/checkpoints/.iter_0000004.tmp/mp_rank_01/model.safetensors: " in line
    assert "No space left on device" in line
    assert _iters(full) == [2] and not (full / "checkpoints" / ".iter_0000004.tmp").exists()


def test_a_run_that_fails_at_start_is_one_line_and_leaves_nothing(tmp_path):
    """A wrong --model path, and a TP that does not divide the KV heads nor is a multiple of them (found when the
    shards are cut)."""
    stories = _assets()
    model = save_tiny("llama3", tmp_path / "kv3", hidden_size=48, num_attention_heads=6, num_key_value_heads=3)
    for tokenizer_file in stories.glob("tok*"):
        shutil.copy(tokenizer_file, model)
    for path, line in ((tmp_path / "nowhere", f"error: {tmp_path / 'nowhere'}: no such folder"),
                       (model, "error: config.json field num_key_value_heads: 3 is not divisible by TP=2, nor TP by it "
                               "(fewer KV heads than TP ranks are replicated, which needs TP to be a multiple of them)")):
        out = tmp_path / "runs" / path.name
        assert _one_error(*_workers(_args(path, out, 2), 2)) == line
        assert not (tmp_path / "runs").exists()  # no lock, no copied HF files, no folder
