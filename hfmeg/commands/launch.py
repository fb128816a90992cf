"""`hfmeg launch torchrun|accelerate ARGS...`: the launcher, run in this process, with a signal's exit code.

Why it exists: Ctrl-C stops an hfmeg run with a checkpoint and exit 130 on every rank, but the launcher's own
process decides what the shell sees, and a plain `torchrun` (and `accelerate launch` with several processes,
which runs torchrun's agent) ends a signalled job with torch's `SignalException` traceback and exit 1, whatever
the workers exited with. In torch 2.13.0: the agent installs `_terminate_process_handler` for SIGINT/SIGTERM
(`torch/distributed/elastic/multiprocessing/api.py:546`, in `PContext.start`), which raises `SignalException`
(`:86`); the agent's `run` (`elastic/agent/server/api.py:752-756`) sends the signal on to the workers, waits
for them and raises it again; `launch_agent` (`launcher/api.py:391-397`) re-raises it, and `main`
(`run.py:1025-1028`) has no handler, so the interpreter prints it and exits 1. The workers' exit codes are not
read on that path, and nothing a worker does can change its parent's signal handler, so no fix inside hfmeg's
ranks can make a plain `torchrun` exit 130. `accelerate launch` with one process (its simple launcher) waits on the worker in
`subprocess.Popen.wait`, where Ctrl-C raises KeyboardInterrupt: a traceback, and the shell gets its prompt
back while the worker is still saving.

This command runs the same launcher code (torchrun's `main`, accelerate's `launch_command`, every flag as
there) and only changes how a signal ends it: the job's stop on SIGINT/SIGTERM exits 128 + the signal, with one
line and no traceback, after the workers have saved and exited; any other outcome is the launcher's own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from ..flags import Parser

LAUNCHERS = ("torchrun", "accelerate")
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _children() -> list[int]:
    """This process's child processes (Linux: /proc; elsewhere none known)."""
    pids = []
    for task in Path("/proc/self/task").glob("*"):
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids


class _WaitForWorker:
    """accelerate's simple launcher: a signal goes on to the worker and the launcher keeps waiting for it.

    Ctrl-C reaches the worker from the terminal anyway (one process group); a scheduler's SIGTERM to the
    launcher alone would not, hence the forwarding (a worker that got it twice records it once). Before a
    worker exists there is nothing to wait for, and the signal ends the launcher as Python's default does."""

    def __init__(self):
        self.signum = 0
        self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        children = _children()
        if not children:
            raise KeyboardInterrupt
        for pid in children:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def _torchrun(argv: list[str]) -> int:
    from torch.distributed.run import main as torchrun_main

    torchrun_main(argv)
    return 0


def _accelerate(argv: list[str]) -> int:
    from accelerate.commands.launch import launch_command, launch_command_parser

    args = launch_command_parser().parse_args(argv)
    wait = _WaitForWorker()  # torchrun's agent, where accelerate starts one, installs its own handlers over it
    try:
        launch_command(args)
    except subprocess.CalledProcessError as e:  # the simple launcher: the worker's own exit code, not a traceback
        if wait.signum:
            raise _Stopped(wait.signum) from None
        return 128 - e.returncode if e.returncode < 0 else e.returncode
    finally:
        wait.restore()
    if wait.signum:
        raise _Stopped(wait.signum)
    return 0


class _Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def main(argv: list[str], prog: str = "hfmeg launch") -> int:
    if not argv or argv[0] not in LAUNCHERS:
        ap = Parser(prog=prog, description="torchrun or accelerate launch, with their own flags, except that a job "
                    "stopped by a signal (Ctrl-C: SIGINT) exits 128 + the signal with one line, after its workers "
                    "saved and exited")
        ap.add_argument("launcher", choices=LAUNCHERS,
                        help="torchrun (its flags follow) or accelerate (`accelerate launch`'s flags follow)")
        ap.parse_args(argv[:1])  # --help, or the usage and exit 2
        return 2
    from torch.distributed.elastic.multiprocessing.api import SignalException

    sys.argv[0] = f"{prog} {argv[0]}"  # the launcher's usage line names this command
    try:
        return {"torchrun": _torchrun, "accelerate": _accelerate}[argv[0]](argv[1:])
    except SignalException as e:
        signum = int(e.sigval)
    except _Stopped as e:
        signum = e.signum
    except KeyboardInterrupt:  # before the agent started its workers (rendezvous), or with no worker yet
        signum = int(signal.SIGINT)
    code = 128 + signum
    print(f"{prog}: the job stopped on {signal.Signals(signum).name} (exit {code})", file=sys.stderr, flush=True)
    return code
