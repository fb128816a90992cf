"""Faults under a real `torchrun` of 4 workers (2 for the lock): what the launcher reports of hfmeg's processes.

- a refused `--out` lock (another run holds it): one error line for the job, exit 2 from every rank;
- one rank killed: the survivors stop by themselves, fast, with no traceback and no SIGKILL from the agent;
- Ctrl-C (SIGINT to the launcher's process group, as a terminal sends it): a checkpoint saved, exit 130, in one
  process and under `hfmeg launch torchrun|accelerate` (a plain torchrun's agent exits 1 on a signal whatever its
  workers do: hfmeg/commands/launch.py says where in torch).

Slow (a torchrun job of 4 interpreters each); bounds come from the run's settings, not from a quiet machine.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hfmeg.train.run_lock import RunLock
from test_train import ALPACA, _assets

MONITOR_S = 0.5  # torchrun's --monitor-interval here: how soon the agent sees a worker gone
# The survivors' exit after a kill: the agent's monitor interval, then each survivor's poll for the signal
# (heartbeat.SIGNAL_POLL_S) and its exit; the 10 s is far above both.
SURVIVORS_EXIT_S = 10.0
EXITCODE = re.compile(r"rank\s*: (\d+) \(local_rank: \d+\)\n\s*exitcode\s*: (-?\d+)")


def _torchrun(out: Path, *flags: str, launcher: tuple[str, ...] = (), world: int = 4, **kw) -> subprocess.Popen:
    """`torchrun LAUNCHER -m hfmeg train FLAGS` on `world` CPU workers, its output merged."""
    return _launch([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                    "--monitor-interval", str(MONITOR_S), *launcher, "-m", "hfmeg", "train", "--recipe",
                    "sft_llama13b"], out, *flags, **kw)


def _launch(launcher: list[str], out: Path, *flags: str, **kw) -> subprocess.Popen:
    """`LAUNCHER` (ending in what runs the SFT recipe) with a short CPU run's flags, its output merged."""
    env = {**os.environ, "HFMEG_BACKEND": "gloo", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("RANK", None)
    cmd = [*launcher, "--model", str(_assets()), "--data", str(ALPACA), "--seq-len", "64", "--global-batch-size",
           "4", "--micro-batch-size", "1", "--warmup-steps", "0", "--report-to", "none", "--dtype", "fp32", "--out",
           str(out), *flags]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _exit_codes(report: str) -> dict[int, int]:
    """Each failed rank's exit code, from torchrun's ChildFailedError report."""
    return {int(rank): int(code) for rank, code in EXITCODE.findall(report)}


def test_a_refused_lock_is_one_line_and_exit_2_on_every_rank(tmp_path):
    """On 2 workers: the refusal is agreed over the world in one collective (`run_lock.lock_run`), rank 0 speaks and
    every other rank is quiet, which one other rank shows as well as three (each a fresh interpreter)."""
    out = tmp_path / "run"
    holder = RunLock(out)
    assert holder.acquire() is None
    try:
        output = _torchrun(out, "--tp", "2", "--max-steps", "2", world=2).communicate(timeout=600)[0]
    finally:
        holder.release()
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {out}: already in use by another run (host {os.uname().nodename}, pid {os.getpid()});"
                      " wait for it to end or choose another --out"], output
    assert _exit_codes(output) == {0: 2, 1: 2}, output
    assert "forcefully exiting via 9" not in output


def _workers(agent: int) -> dict[int, int]:
    """rank -> pid of the agent's worker processes."""
    found = {}
    for child in Path(f"/proc/{agent}/task/{agent}/children").read_text().split():
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{child}/environ").read_text().split("\0") if "=" in kv)
        if "RANK" in env:
            found[int(env["RANK"])] = int(child)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    return sum('"loss"' in line for line in path.read_text().splitlines()) if path.is_file() else 0


def _wait_for_steps(proc: subprocess.Popen, out: Path, steps: int) -> None:
    deadline = time.monotonic() + 400
    while _steps(out) < steps:
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline
        time.sleep(0.2)


def _worker_logs(log_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(log_dir.rglob("*.log")))


def test_survivors_of_a_killed_rank_stop_at_once_without_tracebacks(tmp_path):
    """Rank 2 of TP2 x DP2 killed mid-run: the agent stops the others (SIGTERM), and each exits within the
    agent's monitor interval plus one poll of the signal, not after the agent's 30 s grace and its SIGKILL."""
    out, logs = tmp_path / "run", tmp_path / "logs"
    proc = _torchrun(out, "--tp", "2", "--max-steps", "100000", "--save-every", "0",
                     launcher=("--log-dir", str(logs), "--redirects", "3"))
    try:
        _wait_for_steps(proc, out, 2)
        workers = _workers(proc.pid)
        assert sorted(workers) == [0, 1, 2, 3]
        os.kill(workers[2], signal.SIGKILL)
        killed = time.monotonic()
        survivors = [pid for rank, pid in workers.items() if rank != 2]
        while any(map(_alive, survivors)) and time.monotonic() - killed < 60:
            time.sleep(0.05)
        took = time.monotonic() - killed
        output = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert took < SURVIVORS_EXIT_S, (took, output)
    assert "forcefully exiting via 9" not in output, output
    worker_output = _worker_logs(logs)
    assert "Traceback" not in worker_output and "Exception raised from" not in worker_output, worker_output
    lines = [line for line in worker_output.splitlines() if line.startswith("hfmeg: rank")]
    assert len(lines) <= 3, worker_output  # one line each at most


RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "sft_llama13b.py")
HFMEG_LAUNCH = [sys.executable, "-m", "hfmeg", "launch"]
LAUNCHERS = {
    "one process": [sys.executable, RECIPE, "--tp", "1"],
    "hfmeg launch torchrun": [*HFMEG_LAUNCH, "torchrun", "--nproc-per-node", "2", "--monitor-interval",
                              str(MONITOR_S), RECIPE, "--tp", "2"],
    "hfmeg launch accelerate": [*HFMEG_LAUNCH, "accelerate", "--multi_gpu", "--num_processes", "2",
                                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                                "--monitor_interval", str(MONITOR_S), RECIPE, "--tp", "2"],
    "hfmeg launch accelerate, one process": [*HFMEG_LAUNCH, "accelerate", "--num_processes", "1",
                                             "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend",
                                             "no", RECIPE, "--tp", "1"],
}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_ctrl_c_saves_and_exits_130(tmp_path, launcher):
    """Ctrl-C (SIGINT to the terminal's process group) mid-run: a checkpoint of the step every rank stopped at,
    exit 130 from what the shell started, no traceback from any process."""
    out = tmp_path / "run"
    proc = _launch(LAUNCHERS[launcher], out, "--max-steps", "100000", start_new_session=True)
    try:
        _wait_for_steps(proc, out, 2)
        os.killpg(proc.pid, signal.SIGINT)
        output = proc.communicate(timeout=300)[0]
    finally:
        proc.kill()
    step = int((out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())
    assert proc.returncode == 130 and f"SIGINT: saved step {step}" in output, output
    assert "Traceback" not in output and "Exception raised from" not in output, output


STORE_CLIENT = """
import hfmeg, sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=60))
print("connected", flush=True)
try:
    while True:
        store.add("beat", 1)
        time.sleep(0.05)
except dist.DistNetworkError:
    print("lost the store", flush=True)
"""


def test_a_rank_that_loses_the_store_logs_no_cpp_stack_dump():
    """A launcher's worker (LOCAL_RANK set) whose store goes away gets the Python error that hfmeg reports in its one
    line, without c10d's C++ warning and stack dump before it; outside a launcher torch's own logging is kept (the
    control: the same client without LOCAL_RANK logs it)."""
    from hfmeg.parallel.launch import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", "import sys, time, torch.distributed as d; "
                               f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False); "
                               "print('up', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "TORCH_CPP_LOG_LEVEL")}
    clients = {}
    try:
        assert server.stdout.readline().strip() == "up"
        clients = {rank: subprocess.Popen([sys.executable, "-c", STORE_CLIENT, str(port)],
                                          env={**env, **({"LOCAL_RANK": "0"} if rank else {})},
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for rank in (True, False)}
        for client in clients.values():
            assert client.stdout.readline().strip() == "connected", client.communicate(timeout=60)
        server.kill()
        outputs = {rank: client.communicate(timeout=120) for rank, client in clients.items()}
    finally:
        server.kill()
        for client in clients.values():
            client.kill()
    for out, _ in outputs.values():
        assert out.strip() == "lost the store"
    assert "Exception raised from" in outputs[False][1]  # torch's C++ warning, outside a launcher
    assert "Exception raised from" not in outputs[True][1] and "recvValue" not in outputs[True][1], outputs[True][1]
