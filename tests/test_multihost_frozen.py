"""A frozen rank (SIGSTOP) on namespace hosts, with the store per round that a multi-host job needs
(`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`): rank 0 then holds the job's store, and freezing it froze the
heartbeats with it. Frozen rank 0, and a frozen rank on host B: each is named (rank, host, last step) within
the bound the heartbeat's settings give, and the job restarts by itself (`--max-restarts 3`, torchrun's
agents SIGKILL the frozen worker after their grace period) and ends with the uninterrupted run's final
checkpoint, byte for byte.

The bound: a rank's (or the store's) last answer comes at most one beat (BOUND / BEATS_PER_TIMEOUT) before the
freeze; the survivors name it once it has been silent for the timeout, looking every beat: BOUND + 2 beats,
plus a thread's wake-up on the loaded shared machine (WAKE_S, as test_multihost_faults.py).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from bounds import within
from hfmeg.parallel.heartbeat import BEATS_PER_TIMEOUT
from multihost import wait_all, wait_for, worker_ranks
from test_multihost_faults import (BOUND, FRESH_STORE, LOST_LINE, WAKE_S, _final, _lost_lines, _resumable,
                                   _steps, uninterrupted)

__all__ = ["uninterrupted"]  # the module fixture: the run the frozen ones must reproduce
DETECTED_S = BOUND + 2 * BOUND / BEATS_PER_TIMEOUT + WAKE_S


@pytest.mark.parametrize("host, rank", [(0, 0), (1, 3)])
def test_a_frozen_rank_is_named_and_the_job_recovers(namespace_hosts, tmp_path, uninterrupted, host, rank):
    bed = namespace_hosts(2)
    out = tmp_path / "run"
    logs = [tmp_path / f"host{i}.log" for i in range(2)]
    procs = [bed.torchrun(i, 2, _resumable(out), logs[i], FRESH_STORE, max_restarts=3) for i in range(2)]
    wait_for(lambda: _steps(out) >= 3, 120, "step 3", procs)
    pid = next(p for p, r in worker_ranks(bed, host, procs[host]).items() if r == rank)
    os.kill(pid, signal.SIGSTOP)
    frozen = time.monotonic()
    other = logs[1 - host]  # a survivor on the other host names the frozen rank
    while LOST_LINE not in other.read_text(errors="replace") and time.monotonic() - frozen < 10 * BOUND:
        time.sleep(0.05)
    detected = time.monotonic() - frozen
    lines = _lost_lines(other)
    assert lines and all(f"lost rank {rank} on host {host} (" in line and "(last step " in line for line in lines), \
        other.read_text(errors="replace")[-3000:]
    within(detected, DETECTED_S, f"SIGSTOP of rank {rank} to a survivor's line, s")
    while "resuming from" not in logs[0].read_text(errors="replace") and time.monotonic() - frozen < 300:
        time.sleep(0.1)
    resumed = time.monotonic() - frozen  # the next round's rank 0 has loaded the checkpoint
    codes = wait_all(procs, 300)
    text = "".join(log.read_text(errors="replace") for log in logs)
    assert codes == [0, 0], text[-6000:]
    assert "resuming from" in text
    final, expected = _final(out), _final(uninterrupted[0])
    assert final.keys() == expected.keys() and final == expected, sorted(final)
    report = os.environ.get("HFMEG_BOUND_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(f"frozen rank {rank} (host {host})\tdetected {detected:.1f} s\tresumed {resumed:.1f} s after the "
                    "freeze\n")
