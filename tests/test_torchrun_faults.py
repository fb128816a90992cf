"""Faults under a real `torchrun` of 4 workers: what the launcher reports of hfmeg's processes.

- a refused `--out` lock (another run holds it): one error line for the job, exit 2 from every rank;
- one rank killed: the survivors stop by themselves, fast, with no traceback and no SIGKILL from the agent;
- Ctrl-C (SIGINT to the launcher's process group, as a terminal sends it): a checkpoint saved, exit 130.

Slow (a torchrun job of 4 interpreters each); bounds come from the run's settings, not from a quiet machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from hfmeg.train.run_lock import RunLock
from test_train import ALPACA, _assets

EXITCODE = re.compile(r"rank\s*: (\d+) \(local_rank: \d+\)\n\s*exitcode\s*: (-?\d+)")


def _torchrun(out: Path, *flags: str, world: int = 4, **popen) -> subprocess.Popen:
    env = {**os.environ, "HFMEG_BACKEND": "gloo", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--monitor-interval", "0.5",
           "-m", "hfmeg", "train", "--recipe", "sft_llama13b", "--model", str(_assets()), "--data", str(ALPACA),
           "--seq-len", "64", "--global-batch-size", "4", "--micro-batch-size", "1", "--warmup-steps", "0",
           "--set", "tensorboard=false", "--dtype", "fp32", "--out", str(out), *flags]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def _exit_codes(report: str) -> dict[int, int]:
    """Each failed rank's exit code, from torchrun's ChildFailedError report."""
    return {int(rank): int(code) for rank, code in EXITCODE.findall(report)}


def test_a_refused_lock_is_one_line_and_exit_2_on_every_rank(tmp_path):
    out = tmp_path / "run"
    holder = RunLock(out)
    assert holder.acquire() is None
    try:
        output = _torchrun(out, "--tp", "2", "--max-steps", "2").communicate(timeout=600)[0]
    finally:
        holder.release()
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {out}: already in use by another run (host {os.uname().nodename}, pid {os.getpid()});"
                      " wait for it to end or choose another --out"], output
    assert _exit_codes(output) == {0: 2, 1: 2, 2: 2, 3: 2}, output
    assert "forcefully exiting via 9" not in output
