"""Each process computes with its share of the host's cores, whatever launched it (parallel/threads.py)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time

import pytest
import torch

from hfmeg.parallel import threads
from hfmeg.parallel.threads import CoreShare, cores_per_process, others_running, own_running, rebalance, share_cores


@pytest.fixture
def kept_threads(monkeypatch):
    """The test process's thread count and adaptive share as they were (a forked test child must not find more
    threads than the pool it inherits: tests/forkrun.py)."""
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_adaptive", None)
    yield
    torch.set_num_threads(before)


def test_the_cores_are_shared_out_over_the_local_processes(monkeypatch, kept_threads):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert cores_per_process() == cores  # one process: every core
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cores_per_process() == max(1, cores // 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * cores))
    assert cores_per_process() == 1  # never none
    assert share_cores() == 1 and torch.get_num_threads() == 1
    assert rebalance() is None  # ranks that share a host keep their share: the other ranks are not load


def test_a_process_alone_re_chooses_its_threads_only_where_hfmeg_chose_them(monkeypatch, kept_threads):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "cores_per_process", lambda: 4)
    share_cores()
    assert isinstance(threads._adaptive, CoreShare) and threads._adaptive.cores == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's (or a launcher's) own count is kept
    share_cores()
    assert rebalance() is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(threads, "cores_per_process", lambda: 1)  # one core: nothing to re-choose
    share_cores()
    assert rebalance() is None


def test_the_count_follows_the_median_of_the_last_reads(monkeypatch, kept_threads):
    """The cores less the other runnable tasks (median of the last WINDOW reads), at least one: a load that
    comes takes threads away after a majority of the window saw it, and they come back once it has gone."""
    reads = iter([0, 3, 3, 3, 3, 1, 0, 0, 0, 0, 0])
    monkeypatch.setattr(threads, "others_running", lambda: next(reads))
    share = CoreShare(4)
    counts = [share.rebalance() for _ in range(11)]
    # windows: [0] [0,3] [0,3,3] [0,3,3,3] [0,3,3,3,3] [3,3,3,3,1] [3,3,3,1,0] [3,3,1,0,0] [3,1,0,0,0] ...
    assert counts == [4, 4, 1, 1, 1, 1, 1, 3, 4, 4, 4]
    assert torch.get_num_threads() == 4


def test_a_busy_process_on_the_machine_is_counted(kept_threads):
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # running, past its interpreter's start
        during = [others_running() for _ in range(5)]
    finally:
        spinner.kill()
        spinner.wait()
    # A busy process is runnable at every read (running or queued), whatever else the machine runs.
    assert min(during) >= 1, during


def test_this_process_s_own_computing_threads_are_not_load(kept_threads):
    """What `others_running` subtracts: this process's runnable threads, here the reading thread and a second one
    computing (a data prefetch thread's work is not the machine's load)."""
    assert own_running() >= 1
    a = torch.randn(512, 512)
    done = threading.Event()

    def compute():
        torch.set_num_threads(1)
        while not done.is_set():
            a @ a

    worker = threading.Thread(target=compute)
    worker.start()
    try:
        time.sleep(0.2)
        own = [own_running() for _ in range(5)]
    finally:
        done.set()
        worker.join()
    assert statistics.median_low(own) >= 2, own  # both runnable at every read, running or queued


def test_a_forked_child_keeps_the_count_it_was_given(monkeypatch, kept_threads):
    """GNU OpenMP's pool does not survive fork: a forked child (launch.spawn's ranks) must never raise its count."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "cores_per_process", lambda: 2)
    share_cores()
    assert threads._adaptive is not None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child, given one thread: whether it would re-choose, and the count its share_cores sets
        torch.set_num_threads(1)
        os.write(write, b"none" if rebalance() is None else b"adaptive")
        os.write(write, f" {share_cores()} {threads._adaptive is None}".encode())
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 64) == b"none 1 True"
