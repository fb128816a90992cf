"""Each process computes with its share of the host's cores, whatever launched it (parallel/threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from hfmeg.parallel.threads import cores_per_process, share_cores


def test_the_cores_are_shared_out_over_the_local_processes(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert cores_per_process() == cores  # one process: every core
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cores_per_process() == max(1, cores // 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * cores))
    assert cores_per_process() == 1  # never none
    before = torch.get_num_threads()
    try:
        assert share_cores() == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_importing_hfmeg_asks_openmp_to_wait_passively_before_torch_starts_it():
    """A bare interpreter (no torch imported: hfmeg's own import must not load it) gets PASSIVE; a user's own
    setting is kept."""
    code = "import sys, os, hfmeg; print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert run.stdout.split() == ["PASSIVE", "False"], run.stderr
    run = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
                         capture_output=True, text=True, timeout=60)
    assert run.stdout.split() == ["ACTIVE", "False"], run.stderr
