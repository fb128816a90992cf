"""A host lost, a link down, a rank stopped, a host's workers killed: across namespace hosts (tests/multihost.py).

Runs are TP2 inside a host x DP2 across two hosts, with `train.heartbeat_timeout_s` BOUND. A survivor
prints its line and exits at most BOUND after a peer's last beat, which comes before the loss
(parallel/heartbeat.py): the line is timed against BOUND + WAKE_S (a thread's wake-up on a loaded 2-core
machine shared with other suites). The survivors' launcher notices within its monitor interval
(MONITOR_S, tests/multihost.py) and then stops the host's other workers and reports (GRACE_S). A stopped
rank stops beating at once, so the same bound holds; the issue asks for twice BOUND.

`HFMEG_HOST_KILLS=5` kills five times at seeded steps instead of the suite's once (the issue's sweep).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest
from safetensors import safe_open

from bounds import within
from hfmeg.checkpoint.mp_layout import LATEST_FILE, WRITER_KEY
from hfmeg.optim.state_io import read_meta
from hfmeg.parallel.grid import RankGrid
from hfmeg.train.checkpointing import STALE_PATTERNS
from hfmeg.train.metrics import read_metrics
from multihost import MONITOR_S, Hosts, train_args, wait_all, wait_for, worker_ranks
from test_train import ALPACA, _assets

BOUND = 4.0
WAKE_S = 1.0
GRACE_S = 3.0
LOST_LINE = "hfmeg: lost "


def _steps(out) -> int:
    path = out / "metrics.jsonl"
    return len([r for r in read_metrics(path) if "loss" in r]) if path.is_file() else 0


def _start(bed: Hosts, tmp_path, *flags: str, steps: int = 100000, **kw):
    out = tmp_path / "run"
    args = train_args(_assets(), ALPACA, out, "--tp", "2", "--set", f"train.heartbeat_timeout_s={BOUND}", *flags,
                      steps=steps)
    logs = [tmp_path / f"host{i}.log" for i in range(bed.n)]
    return out, logs, [bed.torchrun(i, 2, args, logs[i], **kw) for i in range(bed.n)]


def _time_to_exit(procs, log) -> tuple[float, float]:
    """Seconds from now to the first survivor's line in `log`, and to the exit of the launcher `procs[0]`."""
    t0, line = time.monotonic(), None
    while procs[0].poll() is None and time.monotonic() - t0 < BOUND * 4:
        if line is None and LOST_LINE in log.read_text(errors="replace"):
            line = time.monotonic() - t0
        time.sleep(0.05)
    seconds = time.monotonic() - t0
    return (seconds if line is None else line), seconds


def _lost_lines(log) -> list[str]:
    """The survivors' lines (each may follow rank 0's progress bar, which ends without a newline)."""
    text = log.read_text(errors="replace").replace("\r", "\n")
    return [LOST_LINE + part.split("\n", 1)[0] for part in text.split(LOST_LINE)[1:]]


@pytest.mark.parametrize("how", ["processes-killed", "link-down"])
def test_survivors_name_the_lost_host_and_stop_within_the_bound(namespace_hosts, tmp_path, how):
    bed = namespace_hosts(2)
    out, logs, procs = _start(bed, tmp_path)
    wait_for(lambda: _steps(out) >= 2, 120, "second step", procs)
    lost = sorted(worker_ranks(bed, 1, procs[1]).values())
    if how == "link-down":
        bed.link_down(1)
    else:
        for pid in bed.pids(1):
            os.kill(pid, signal.SIGKILL)
    line_s, exit_s = _time_to_exit(procs, logs[0])
    assert procs[0].returncode not in (None, 0), logs[0].read_text()[-3000:]
    lines = _lost_lines(logs[0])
    # One line from a survivor, naming both lost ranks; its neighbour on the host prints the same line unless
    # the agent, stopping the host's workers once one has exited, ends it first.
    assert 1 <= len(lines) <= 2, logs[0].read_text()[-3000:]
    assert all(f"lost ranks {lost[0]}, {lost[1]} on host" in line and f"{bed.addr(1)})" in line for line in lines), \
        lines
    within(line_s, BOUND + WAKE_S, f"loss ({how}) to a survivor's line, s")
    within(exit_s, BOUND + WAKE_S + MONITOR_S + GRACE_S, f"loss ({how}) to the survivors' launcher's exit, s")


def test_a_stopped_rank_is_named_within_twice_the_bound(namespace_hosts, tmp_path):
    bed = namespace_hosts(2)
    out, logs, procs = _start(bed, tmp_path)
    wait_for(lambda: _steps(out) >= 2, 120, "second step", procs)
    pid, rank = next(iter(worker_ranks(bed, 1, procs[1]).items()))
    os.kill(pid, signal.SIGSTOP)
    line_s, exit_s = _time_to_exit(procs, logs[0])
    lines = _lost_lines(logs[0])
    assert 1 <= len(lines) <= 3 and all(f"lost rank {rank} on host" in line for line in lines), \
        logs[0].read_text()[-3000:]
    within(line_s, 2 * BOUND, "SIGSTOP of one rank to a survivor's line, s")
    within(exit_s, 2 * BOUND + MONITOR_S + GRACE_S, "SIGSTOP of one rank to the survivors' launcher's exit, s")


# 8 steps, a save every 2: the kill lands between saves at a seeded step (step 4 for seed 0), a resume has a complete
# checkpoint behind it and work after it, and --keep-last 2 has pruned by the end; what these tests assert (writers,
# `latest`, the bytes after a recovery) does not depend on more steps, each of which costs every rank a step and, every
# second one, a save.
STEPS, SAVE_EVERY = 8, 2


@pytest.fixture(scope="module")
def uninterrupted(multihost_run):
    """The `<out>` and logs of the run the killed ones must reproduce: 2 hosts x 2 ranks writing one `--out`; run
    once per session (test_multihost_frozen's frozen runs must reproduce it too, and test_multihost_parity compares
    its losses with a one-host run's)."""
    return multihost_run("uninterrupted", 2, 2, _resumable, max_restarts=3)


def _writer(path) -> int:
    with safe_open(str(path), "pt") as f:
        return int(f.metadata()[WRITER_KEY])


def test_one_writer_per_shard_and_latest_after_all_on_a_shared_out(uninterrupted):
    """Every model shard written by the DP-rank-0 rank of its TP coordinate, every optimizer shard by the rank at
    its coordinates, on that rank's host; `latest` names the last save and is newer than every file of it (the
    saver's rank 0 writes it after the rename, which comes after every rank reported its part written); no
    temporary left; the export once, by rank 0 on host 0. That a resume across hosts reproduces this run byte
    for byte is `test_a_host_killed_mid_run_comes_back_to_the_same_model`."""
    out, logs = uninterrupted
    grid = RankGrid.of_world(4, tp=2, per_host=2)  # TP2 inside a host, DP2 across
    root = out / "checkpoints"
    saves = sorted(p.name for p in root.glob("iter_*"))
    assert saves == [f"iter_{s:07d}" for s in (STEPS - SAVE_EVERY, STEPS)]  # --keep-last 2
    assert (root / LATEST_FILE).read_text().strip() == str(STEPS)
    for name in saves:
        folder = root / name
        model = {tp: _writer(folder / f"mp_rank_{tp:02d}" / "model.safetensors") for tp in range(2)}
        assert model == {tp: grid.rank(tp=tp, dp=0) for tp in range(2)}
        optim = {f.name: read_meta(f)["writer"] for f in (folder / "optim").glob("*.safetensors")}
        assert optim == {f"optim_pp000_tp{tp:02d}_dp{dp:03d}.safetensors": grid.rank(tp=tp, dp=dp)
                         for tp in range(2) for dp in range(2)}
        assert {grid.host(r) for r in optim.values()} == {0, 1}  # each host wrote its own ranks' shards
    newest = max(p.stat().st_mtime_ns for p in (root / saves[-1]).rglob("*") if p.is_file())
    assert (root / LATEST_FILE).stat().st_mtime_ns >= newest
    assert not [p for sub, names in STALE_PATTERNS.items() for n in names for p in (out / sub).glob(n)]
    assert json.loads((out / "export.json").read_text())["step"] == STEPS
    assert (out / "hf" / "model.safetensors").is_file()
    said = {i: (logs / f"host{i}.log").read_text(errors="replace").count(f"{out / 'hf'}") for i in range(2)}
    assert said[0] >= 1 and said[1] == 0, said


def _resumable(out) -> list[str]:
    return train_args(_assets(), ALPACA, out, "--tp", "2", "--save-every", str(SAVE_EVERY), "--keep-last", "2",
                      "--resume", "auto", "--set", f"train.heartbeat_timeout_s={BOUND}", steps=STEPS)


def _final(out) -> dict[str, bytes]:
    folder = out / "checkpoints" / f"iter_{STEPS:07d}"
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*.safetensors"))}


class _Milestones:
    """When the steps of a recovery first show in host 0's log (for the report: where the seconds go). The
    agent's own steps show with torch's LOGLEVEL=INFO in the environment."""

    MARKS = {"the survivors' line": LOST_LINE, "host 0's agent restarts its workers": "will restart worker group",
             "the next round's workers start": "Starting worker group", "rank 0 resumes": "resuming from"}

    def __init__(self, log):
        self.log, self.times = log, {}
        self.before = {what: self._text().count(mark) for what, mark in self.MARKS.items()}

    def _text(self) -> str:
        return self.log.read_text(errors="replace")

    def at(self, what: str) -> None:
        self.times[what] = time.monotonic()

    def poll(self) -> str:
        text = self._text()
        for what, mark in self.MARKS.items():
            if what not in self.times and text.count(mark) > self.before[what]:
                self.at(what)
        return text


# The agents' store for each round afresh: without it, an agent started again after its host was lost cannot
# join (torch: a node new to a later round waits for the store's address, which only the first round writes).
FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@pytest.mark.parametrize("lost, seed", [("workers", s) for s in range(int(os.environ.get("HFMEG_HOST_KILLS", "1")))]
                         + [("host", 0)])
def test_a_host_killed_mid_run_comes_back_to_the_same_model(namespace_hosts, tmp_path, uninterrupted, lost, seed):
    """torchrun --max-restarts 3, killed at a seeded random step: host 1's workers (its agent restarts them,
    on torch's shared store), or all of host 1 (the scheduler starts its torchrun again, here after 2 s, on a
    store per round). The job restarts by itself, resumes from its newest complete checkpoint and ends with
    the uninterrupted run's final checkpoint, byte for byte."""
    bed = namespace_hosts(2)
    out = tmp_path / "run"
    logs = [tmp_path / f"host{i}.log" for i in range(3)]
    env = FRESH_STORE if lost == "host" else {}
    procs = [bed.torchrun(i, 2, _resumable(out), logs[i], env, max_restarts=3) for i in range(2)]
    at_step = random.Random(seed).randrange(1, STEPS - 1)
    wait_for(lambda: _steps(out) >= at_step, 120, f"step {at_step}", procs)
    saved = (out / "checkpoints" / "latest_checkpointed_iteration.txt").is_file()  # else it starts over
    for pid in (bed.pids(1) if lost == "host" else worker_ranks(bed, 1, procs[1])):
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    seen = _Milestones(logs[0])
    if lost == "host":
        procs[1].wait()
        time.sleep(2)
        procs[1] = bed.torchrun(1, 2, _resumable(out), logs[2], env, max_restarts=3)
        seen.at("host 1's torchrun started again")
    while saved and "resuming from" not in seen.poll() and time.monotonic() - killed < 180:
        time.sleep(0.05)
    resumed = time.monotonic() - killed  # the next round's rank 0 has loaded the checkpoint
    codes = wait_all(procs, 180)
    if saved and os.environ.get("HFMEG_BOUND_REPORT"):
        with open(os.environ["HFMEG_BOUND_REPORT"], "a") as f:
            f.write(f"host 1's {lost} killed after step {at_step}\tresumed {resumed:.1f} s after the kill\t"
                    + ", ".join(f"{what} {t - killed:.1f} s" for what, t in seen.times.items()) + "\n")
    text = "".join(log.read_text(errors="replace") for log in logs if log.is_file())
    assert codes == [0, 0], "\n".join(log.read_text(errors="replace")[-3000:] for log in logs if log.is_file())
    assert ("resuming from" in text) == saved, saved
    final, expected = _final(out), _final(uninterrupted[0])
    assert final.keys() == expected.keys() and final == expected, sorted(final)
