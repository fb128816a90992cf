"""One run per `--out`: an advisory lock that rank 0 holds for the run's life.

Two runs writing one `--out` interleave their metrics and race on the same
checkpoint folders. So rank 0 takes `fcntl.flock` on `<out>/.lock` before anything
is written there and keeps the file open until the run ends; the file records
the holder's host and pid, which a refused second run names. The kernel releases
a flock when its holder dies (also on kill -9), so a lock file that still names a
holder but can be locked was left by a run that died: it is taken over with a
note. A clean end empties the file. Every rank learns rank 0's verdict through `agree`, so a
refused run stops on all ranks, with one line for the job, instead of hanging in a collective.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
from pathlib import Path

from ..errors import RunLockedError
from ..parallel.agree import agree

LOCK_FILE = ".lock"


class RunLock:
    def __init__(self, out: Path):
        self.path = Path(out) / LOCK_FILE
        self._fd: int | None = None
        self.created: list[Path] = []

    def acquire(self) -> str | None:
        """Take the lock or raise `RunLockedError` naming the holder; returns a note on a stale lock taken over."""
        out = self.path.parent.absolute()
        self.created = [d for d in (out, *out.parents) if not d.exists()]  # innermost first
        try:
            out.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise RunLockedError(f"{self.path}: cannot create the run's lock file ({e.strerror or e})") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read(fd))
            os.close(fd)
            raise RunLockedError(f"{self.path.parent}: already in use by another run ({holder}); wait for it to end "
                                 "or choose another --out") from None
        previous = _read(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        if previous:
            return f"{self.path}: took over the lock of a run that is gone ({_describe(previous)})"
        return None

    def release(self, *, forget: bool = False) -> None:
        """End the hold. `forget`: the run never started (it failed at start-up), so it leaves nothing: the
        lock file goes, and the folders taking it created if they are empty again."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)  # an empty file: the run ended cleanly, nothing to take over
        if forget:
            self.path.unlink(missing_ok=True)  # before the flock goes, so no other run can hold this file
        os.close(self._fd)  # closing the only descriptor releases the flock
        self._fd = None
        for folder in self.created if forget else ():
            try:
                folder.rmdir()
            except OSError:  # not empty: something else lives there
                break


def _read(fd: int) -> dict | None:
    raw = os.pread(fd, 4096, 0)
    try:
        found = json.loads(raw) if raw.strip() else None
    except ValueError:
        found = {"content": raw[:80].decode(errors="replace")}
    return found if isinstance(found, dict) else None


def _describe(holder: dict | None) -> str:
    if not holder:
        return "holder unknown"
    if "content" in holder:
        return f"lock file reads {holder['content']!r}"
    return f"host {holder.get('host')}, pid {holder.get('pid')}"


def lock_run(out: Path, ps) -> RunLock | None:
    """Collective: rank 0 takes `out`'s lock (returned; None elsewhere); a refusal is agreed (`parallel.agree`):
    every rank raises rank 0's error, which rank 0 alone prints, and every rank exits 2."""
    lock, error = None, None
    if ps.rank == 0:
        lock = RunLock(out)
        try:
            note = lock.acquire()
            if note:
                print(note, file=sys.stderr, flush=True)
        except RunLockedError as e:
            lock, error = None, e
    agree(error, ps.device)
    return lock
