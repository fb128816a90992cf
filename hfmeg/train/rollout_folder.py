"""The shared-memory folder a GRPO run exports its weights to for the generation engine, and who owns it.

Rank 0 of a GRPO run exports the weights for its engine to `/dev/shm/hfmeg-rollout-<hash of its out>`
(rollout.py) and removes it when the run ends, by an error or Ctrl-C too. A SIGKILLed run cannot, and its folder
(the whole model, in RAM) would stay until a run of the same out ended. So the run that uses the folder holds an
flock on `<folder>/owner.lock` while it lives (the kernel releases it when the process dies, kill -9 included; the
descriptor is close-on-exec, so no engine process it starts keeps it), and every GRPO run's rank 0, at its start,
removes each `hfmeg-rollout-*` folder whose lock it can take: its owner is gone (`sweep`). The lock file is locked
under a name of its own and then renamed into place, so a sweep never finds a live run's lock file unlocked.
Folders with no lock file (an hfmeg before this one's) are left alone.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

PREFIX = "hfmeg-rollout-"
OWNER = "owner.lock"


def sweep(parent: Path) -> list[Path]:
    """Remove the `hfmeg-rollout-*` folders in `parent` whose owner is gone (module doc); returns them."""
    removed = []
    for folder in sorted(parent.glob(f"{PREFIX}*")):
        try:
            fd = os.open(folder / OWNER, os.O_RDWR | os.O_CLOEXEC)
        except OSError:  # no owner record, or removed meanwhile by another sweep
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # its run is alive
            os.close(fd)
            continue
        shutil.rmtree(folder, ignore_errors=True)
        os.close(fd)
        removed.append(folder)
    return removed


class RolloutFolder:
    """`folder` (`/dev/shm/hfmeg-rollout-...`), owned by this process from `claim` to `release`."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._fd: int | None = None

    def claim(self) -> list[Path]:
        """Remove the folders of runs that are gone (`sweep`; a killed run of this out's among them), then make
        `folder` and hold its lock. Returns the folders removed."""
        removed = sweep(self.folder.parent)
        self.folder.mkdir(parents=True, exist_ok=True)
        named = self.folder / f".{OWNER}.{os.getpid()}"
        fd = os.open(named, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a file of its own: nobody else holds it
        os.replace(named, self.folder / OWNER)
        self._fd = fd
        return removed

    def release(self) -> None:
        """The folder removed, then the lock let go."""
        shutil.rmtree(self.folder, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
