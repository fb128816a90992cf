"""A run's life around the loop (issue 18): checkpoints that survive resume + pruning, one run
per `--out`, workers that end with their launcher, divergence, and what the run says at its end.

Runs fine-tune stories260K on alpaca_en_demo.json with 64-token rows (seconds each), mostly in
a world of one; the collective parts (the lock verdict, the export after the last collective)
on two forked gloo ranks.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

import hfmeg.train.parts.full as full_part  # its mp_to_hf writes a full run's export
from hfmeg.parallel.launch import spawn, start_method
from hfmeg.train.checkpointing import RunCheckpoints
from hfmeg.train.config import TrainConfig
from hfmeg.train.dataclass_io import ConfigError, build
from hfmeg.train.metrics import read_metrics
from hfmeg.train.run_lock import LOCK_FILE, RunLock, RunLockedError
from hfmeg.train.stop import LauncherGone, LauncherWatch
from hfmeg.train.trainer import Trainer
from test_train import ALPACA, ROOT, _assets, _config, _losses
import forkrun

RECIPE = ROOT / "recipes" / "sft_llama13b.py"


def _run(cfg):
    return Trainer(cfg).run()


def _refusal(cfg) -> str:
    """The RunLockedError this rank stops with (spawn would report only the first rank's)."""
    with pytest.raises(RunLockedError) as e:
        Trainer(cfg)
    return str(e.value)


def _iters(out: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("iter_*"))


def _latest(out: Path) -> int:
    return int((out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())


def _recipe(model: Path, out: Path, *extra: str) -> list[str]:
    return [str(RECIPE), "--model", str(model), "--data", str(ALPACA), "--tp", "1", "--seq-len", "64",
            "--global-batch-size", "4", "--eval-every", "0", "--out", str(out), "--report-to", "none", *extra]


def test_resume_with_pruning_keeps_hf_files_and_says_where_it_resumed(tmp_path, capfd):
    """Issue 18 #1 and #13: 2 steps (save every step, keep 2), then --resume auto to 6."""
    model = _assets()
    out = tmp_path / "run"
    cfg = _config(out, model, steps=2, save_every=1, schedule_steps=6)
    cfg.report_to = ["tensorboard"]
    spawn(_run, 1, cfg)
    first = capfd.readouterr().out
    cfg = _config(out, model, steps=6, save_every=1, resume="auto")
    result = spawn(_run, 1, cfg)[0]
    log = capfd.readouterr().out
    # Kept: the newest two, and iter 2, which this run resumed from.
    assert _iters(out) == [2, 5, 6] and _latest(out) == 6
    for n in _iters(out):
        assert (out / "checkpoints" / f"iter_{n:07d}" / "hf" / "config.json").is_file(), n
    AutoModelForCausalLM.from_pretrained(result.hf_folder)
    AutoTokenizer.from_pretrained(result.hf_folder)
    assert f"resuming from {out / 'checkpoints' / 'iter_0000002'} (step 2)" in log
    summary = log[log.index("run finished: step 6/6, resumed at step 2; 4 steps in"):]
    assert f"{result.summary.tokens:,} label tokens, 0 skipped steps" in summary
    assert f"final train loss {_losses(out)[-1]:.4f}" in summary
    report = json.loads((out / "checkpoints" / "iter_0000006" / "trainer_state.json").read_text())["data"]["report"]
    assert report["counts"], "64-token rows cut alpaca records: the summary must have problems to report"
    for kind, n in report["counts"].items():
        assert f"data problem {kind}: {n:,} records (first: {report['first'][kind]})" in summary
    for label, path in (("metrics", "metrics.jsonl"), ("loss curve", "loss.png"),
                        ("checkpoint", "checkpoints/iter_0000006"), ("model", "hf")):
        assert f"  {label}: {out / path}\n" in summary, label
    # The config is written to OUT/config.yaml, said in one line, not printed; it reads back to the run's config.
    assert first.count(f"config: {out / 'config.yaml'}\n") == 1 and "keep_last" not in first
    saved = build(TrainConfig, yaml.safe_load((out / "config.yaml").read_text()))  # this session's: 6 steps
    assert saved.to_dict()["train"] == cfg.to_dict()["train"] and saved.train.max_steps == 6


def test_pruning_after_resuming_from_an_earlier_checkpoint(tmp_path):
    """Issue 18 #3: resume from iter 6 with iter 8 present, keep 1: the new iter 7 stays (and `latest` names it)."""
    model = _assets()
    out = tmp_path / "run"
    cfg = _config(out, model, steps=8, save_every=1)
    cfg.checkpoint.keep_last = 10
    spawn(_run, 1, cfg)
    assert _iters(out) == list(range(1, 9))
    cfg = _config(out, model, steps=7, save_every=1, resume=str(out / "checkpoints" / "iter_0000006"),
                  schedule_steps=8)
    cfg.checkpoint.keep_last = 1
    result = spawn(_run, 1, cfg)[0]
    # 8 came from the abandoned timeline; 6 is what this run resumed from.
    assert _iters(out) == [6, 7] and _latest(out) == 7
    AutoModelForCausalLM.from_pretrained(result.hf_folder)


def test_keep_last_below_one_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.keep_last: must be >= 1"):
        RunCheckpoints(tmp_path, keep_last=0, resume="none")


def test_a_locked_out_is_refused_on_every_rank(tmp_path):
    """Issue 18 #4: a second run on a live run's --out stops at start, naming the holder."""
    model = _assets()
    out = tmp_path / "run"
    holder = RunLock(out)
    assert holder.acquire() is None
    try:
        errors = spawn(_refusal, 2, _config(out, model, tp=2, steps=1))
        # agreed: every rank raises rank 0's error (which the CLI prints once, from rank 0)
        assert f"already in use by another run (host {socket.gethostname()}, pid {os.getpid()})" in errors[0]
        assert errors[1] == errors[0]
        assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
    finally:
        holder.release()
    # Released cleanly: the next run takes the lock without a note and trains.
    assert RunLock(out).acquire() is None


def test_a_stale_lock_is_taken_over_with_a_note(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "node7", "pid": dead.pid}))
    lock = RunLock(tmp_path)
    note = lock.acquire()
    assert note is not None and f"took over the lock of a run that is gone (host node7, pid {dead.pid})" in note
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == {"host": socket.gethostname(), "pid": os.getpid()}
    lock.release()


def test_launcher_watch_stops_an_orphan(monkeypatch):
    watch = LauncherWatch(os.getppid())
    watch.check()
    monkeypatch.setattr(os, "getppid", lambda: 1)
    with pytest.raises(LauncherGone, match="is gone"):
        watch.check()
    LauncherWatch(None).check()  # not started by a launcher: nothing to watch


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    try:  # a zombie has finished: only its parent (init, here) has yet to reap it
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
def test_workers_die_with_their_launcher(tmp_path):
    """Issue 18 #4: kill -9 torchrun mid-run; no worker survives it for long."""
    model = _assets()
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           *_recipe(model, out, "--tp", "2", "--max-steps", "100000")]
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    workers: list[int] = []
    try:
        deadline = time.time() + 300
        while not (out / "metrics.jsonl").is_file() or len(_losses(out)) < 1:
            assert launcher.poll() is None and time.time() < deadline
            time.sleep(0.5)
        workers += _children(launcher.pid)
        assert len(workers) == 2, workers
        launcher.kill()
        launcher.wait()
        deadline = time.time() + 30
        while any(_alive(w) for w in workers) and time.time() < deadline:
            time.sleep(0.2)
        assert not [w for w in workers if _alive(w)]
    finally:  # whatever failed, leave no process behind (the workers may be orphans by now)
        for pid in [launcher.pid, *workers, *_children(launcher.pid)]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()


def test_a_diverging_run_saves_and_aborts(tmp_path):
    """Issue 18 #5: --lr 1e6 skips step after step: a checkpoint, one line, exit 2, no export."""
    model = _assets()
    out = tmp_path / "run"
    proc = forkrun.run([sys.executable, *_recipe(model, out, "--lr", "1e6", "--warmup-steps", "0",
                                                    "--max-steps", "40", "--set", "train.max_skipped_steps=3")],
                       timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "train.max_skipped_steps: 3 steps in a row skipped" in lines[-1], proc.stderr
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["skipped"] for r in rows[-3:]] == [True] * 3 and len(rows) < 40
    assert _latest(out) == len(rows) and f"saved step {len(rows)}" in lines[-1]
    assert not (out / "hf").exists()


@pytest.mark.skipif(start_method() != "fork", reason="patches the trainer in this process: the ranks must be forked")
def test_the_export_is_not_inside_a_collective(tmp_path, monkeypatch):
    """Issue 13 #4: while rank 0 exports (and uploads), the other ranks have already returned."""
    model = _assets()
    marker = tmp_path / "rank1_returned"
    real = full_part.mp_to_hf

    def slow_export(*args, **kwargs):
        deadline = time.time() + 300  # waits only until rank 1 has returned; generous for a loaded 2-core box
        while not marker.exists() and time.time() < deadline:
            time.sleep(0.1)
        (tmp_path / "export_saw_rank1_done").write_text(str(marker.exists()))
        return real(*args, **kwargs)

    monkeypatch.setattr(full_part, "mp_to_hf", slow_export)

    def run_and_mark(cfg):
        result = Trainer(cfg).run()
        if not result.is_logger:
            marker.touch()
        return result.hf_folder

    hf = spawn(run_and_mark, 2, _config(tmp_path / "run", model, tp=2, steps=2))
    assert (tmp_path / "export_saw_rank1_done").read_text() == "True"
    assert hf[1] is None and (Path(hf[0]) / "config.json").is_file()
