"""The lane lists (conftest.LANES) name files and tests that exist: a renamed test does not leave the quick lane
silently, nor a stale name keep a test in it."""

from __future__ import annotations

import ast
import os
import select
import time
from pathlib import Path

from conftest import LANES

TESTS = Path(__file__).parent


def test_every_file_and_test_the_lanes_name_exists():
    for lane, files in LANES.items():
        for file, names in files.items():
            assert (TESTS / file).is_file(), (lane, file)
            defined = {n.name for n in ast.walk(ast.parse((TESTS / file).read_text())) if isinstance(n, ast.FunctionDef)}
            assert not (names or set()) - defined, (lane, file, (names or set()) - defined)


def test_a_solo_test_runs_with_no_other_test_beside_it(tmp_path):
    """conftest._machine_share: while one worker runs a test alone, the other's next test waits for it to end, and
    a test that must run alone waits for the other's running test to end."""
    from conftest import _machine_share

    def timeline(alone: bool, hold_s: float, ready) -> None:  # a forked worker: its start and end under the lock
        with _machine_share(tmp_path, alone):
            os.write(ready, b"x")
            start = time.monotonic()
            time.sleep(hold_s)
            (tmp_path / f"{os.getpid()}.txt").write_text(f"{start} {time.monotonic()}")
        os._exit(0)

    def run(first_alone: bool) -> list[tuple[float, float]]:
        read, write = os.pipe()
        pids = []
        for alone in (first_alone, not first_alone):
            pid = os.fork()
            if pid == 0:
                timeline(alone, 0.4, write)
            pids.append(pid)
            if len(pids) == 1:
                os.read(read, 1)  # the first holds its lock before the second asks
        for pid in pids:
            os.waitpid(pid, 0)
        return [tuple(map(float, (tmp_path / f"{pid}.txt").read_text().split())) for pid in pids]

    for first_alone in (True, False):
        (a_start, a_end), (b_start, b_end) = run(first_alone)
        assert b_start >= a_end, (first_alone, a_start, a_end, b_start, b_end)
    with _machine_share(tmp_path, False):  # two shared holders do not wait for each other
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            with _machine_share(tmp_path, False):
                os.write(write, b"x")
            os._exit(0)
        assert select.select([read], [], [], 10)[0], "a second shared holder waited"
        os.waitpid(pid, 0)


def test_a_worker_pins_what_it_starts_to_its_own_core_and_lets_go_after():
    """conftest._own_core: worker gwN's test, and a process it forks meanwhile, run on the N-th core this process may
    use (modulo their count); afterwards every core again."""
    from conftest import _own_core

    cores = sorted(os.sched_getaffinity(0))
    for n in range(len(cores) + 1):
        with _own_core(f"gw{n}"):
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.write(write, ",".join(map(str, sorted(os.sched_getaffinity(0)))).encode())
                os._exit(0)
            os.waitpid(pid, 0)
            os.close(write)
            seen = os.read(read, 100).decode()
            os.close(read)
            assert seen == str(cores[n % len(cores)]), n
        assert sorted(os.sched_getaffinity(0)) == cores
