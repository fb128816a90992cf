"""Run a pure-Python entry point (a recipe, tool or bench script, `-m module`) in a child forked from the test
process instead of a fresh interpreter: `run(argv, ...)` takes what `subprocess.run` would, and gives the same
`CompletedProcess` (text stdout and stderr, the exit code), without the 4-5 s of CPU a fresh interpreter spends
importing torch, transformers and hfmeg before its first line of work.

What the child keeps as a real process start would: argv (`sys.argv`, and `sys.path[0]` the script's folder,
the working directory under `-m`, '' under `-c code`), the environment (`env`, replacing os.environ, as subprocess does), the
working directory, the exit code (`sys.exit(n)`, an uncaught exception is 1 with its traceback on stderr, a
signal is -signum), and stdout and stderr apart, redirected at the file-descriptor level (what C code and the
script's own children write lands there too). Settings that libraries read once at import are read again from
the child's environment (`RELOADED`: huggingface_hub's HF_HUB_OFFLINE, HF_HOME and the caches below it), logging,
warnings and signals start as a fresh interpreter has them, and the child ends with os._exit, running none of
the test process's exit handlers. A run past `timeout` kills the child's process group and raises
subprocess.TimeoutExpired, as subprocess.run does.

Where `hfmeg.parallel.launch` starts ranks by spawn rather than fork (a CUDA machine: a forked child of a process
that touched CUDA cannot use it) the run is a real subprocess.

Kept in a real interpreter on purpose (they call subprocess directly): what must prove a real process start
(`python -m hfmeg --help`, the installed console script, torchrun and accelerate launches, the Slurm stand-ins,
the multi-host beds, a launcher whose workers must die with it), tests/test_tokenizer_lowest.py (another venv's
interpreter), tests/test_import_cost.py (what an import alone pulls into a fresh sys.modules), and runs that
must be signalled or killed from outside while they work (test_train's SIGTERM). `start` runs several at once:
test_checkpoint_recovery's hand-started ranks of one job, each with the job's rendezvous in its environment
(they compute with one thread each, `LOCAL_WORLD_SIZE` ranks sharing the cores, as a launcher's would).

A forked run computes with one thread (the child sets it, and `threads.share_cores` never raises a forked
child's count): GNU OpenMP's thread pool does not survive fork (hfmeg/parallel/launch.py), so a child that
computes with more threads than the test process's pool had waits forever for the missing ones (a parent that ran
a 2-thread op, then a forked child's 2-thread `torch.exp` of 4M values: hung; with 1 thread: done in 0.4 s,
2026-11-29). So the recipe, tool and bench scripts fork whatever they compute (test_train's verify_parity, recipe
and pretraining runs, test_moe_checkpoint's and test_verify_parity's verify_parity, the bench_mfu, bench_peers,
bench_moe, bench_peft, bench_shared_unlock and bench_optimizer runs, test_peft_resume's, test_run_lifecycle's and
test_launch_recipes' recipe runs), and hand-started ranks given `LOCAL_WORLD_SIZE` as a launcher would
(test_checkpoint_recovery's, through `start`). Not moved: test_bench_dpo's run, whose ranks' peak RSS is its
figure (ranks forked from the test process would count its pages)."""

from __future__ import annotations

import faulthandler
import gc
import importlib
import io
import logging
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

from hfmeg.parallel.launch import start_method

RELOADED = ("huggingface_hub.constants",)  # modules whose settings come from the environment at import


def run(argv: list[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
        timeout: float = 300.0) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)`, forked where
    the ranks are forked. `argv[0]` is the interpreter; then a script path, `-m module` or `-c code`, then its
    arguments."""
    return start(argv, env=env, cwd=cwd).wait(timeout)


def start(argv: list[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None) -> "Started":
    """`run` without waiting, as `subprocess.Popen` starts a process: several at once make one job's workers
    (their rendezvous in `env`), each with its own exit code and output; `.wait(timeout)` gives `run`'s result."""
    if start_method() != "fork" or argv[0] != sys.executable or _other_threads():
        return Started(argv, popen=subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                    env=env, cwd=cwd))
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # nothing of the parent's buffered output is written twice
    pid = os.fork()
    if pid == 0:
        os._exit(_child(argv[1:], env, cwd, out.fileno(), err.fileno()))
    return Started(argv, pid=pid, files=(out, err))


class Started:
    """A run in progress: a forked child (`pid`, its output in `files`) or a real process (`popen`)."""

    def __init__(self, argv: list[str], *, pid: int = 0, files=(), popen: subprocess.Popen | None = None):
        self.argv, self.pid, self.files, self.popen = argv, pid, files, popen

    def wait(self, timeout: float = 300.0) -> subprocess.CompletedProcess:
        """Its exit code and output once it ends; past `timeout` it is killed (with its children, for a forked
        run) and subprocess.TimeoutExpired raised, as subprocess.run does."""
        if self.popen is not None:
            try:
                out, err = self.popen.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.communicate()
                raise
            return subprocess.CompletedProcess(self.argv, self.popen.returncode, out, err)
        try:
            code = _wait(self.pid, timeout, self.argv)
            texts = []
            for f in self.files:
                f.seek(0)
                texts.append(f.read().decode(errors="replace"))
        finally:
            for f in self.files:
                f.close()
        return subprocess.CompletedProcess(self.argv, code, *texts)


def _other_threads() -> list[str]:
    """Python threads of the test process besides the main one and tqdm's monitor (whose lock the child replaces):
    a lock such a thread holds at the fork would stay held in the child forever, so then the run is a real one.
    An earlier test's unreachable data prefetcher (in a reference cycle, e.g. held by a caught exception's frames)
    still has its thread until a collection runs its finalizer, which stops and joins the thread: collect first."""
    def others() -> list[str]:
        return [t.name for t in threading.enumerate() if t is not threading.main_thread() and t.name != "tqdm_monitor"]
    if others():
        gc.collect()
    return others()


def _wait(pid: int, timeout: float, argv: list[str]) -> int:
    deadline, pause = time.monotonic() + timeout, 0.005
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)  # the child and whatever it started
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            raise subprocess.TimeoutExpired(argv, timeout)
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


def _child(args: list[str], env: dict[str, str] | None, cwd, out_fd: int, err_fd: int) -> int:
    """The forked child: become the process the argv describes, run it, return its exit code."""
    try:
        os.setpgid(0, 0)  # its own group: a timeout kills its children too
        null = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((null, 0), (out_fd, 1), (err_fd, 2)):
            os.dup2(fd, target)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
        sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr
        faulthandler.disable()  # the test process's points at its own stderr
        if cwd is not None:
            os.chdir(cwd)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        for name in RELOADED:
            if name in sys.modules:
                importlib.reload(sys.modules[name])
        _fresh_interpreter_state()
        if "torch" in sys.modules:  # GNU OpenMP's pool does not survive the fork: one thread, as spawned ranks have
            sys.modules["torch"].set_num_threads(1)
    except BaseException:  # noqa: BLE001 - a broken set-up is the run's failure, reported as such
        traceback.print_exc()
        return _flushed(1)
    try:
        if args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            sys.path[0] = ""
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            script = Path(args[0]).resolve()
            sys.argv = [args[0], *args[1:]]
            sys.path[0] = str(script.parent)
            runpy.run_path(str(script), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except BaseException:  # noqa: BLE001 - an uncaught exception ends a real interpreter with 1 and its traceback
        traceback.print_exc()
        code = 1
    return _flushed(code)


def _fresh_interpreter_state() -> None:
    """tqdm's lock, logging, warnings and signal handlers as a new interpreter starts with them, not as the test
    process (pytest, its other threads) left them."""
    tqdm = sys.modules.get("tqdm.std")
    if tqdm is not None:  # its write lock may be held by the monitor thread, which the child does not have
        tqdm.tqdm.set_lock(tqdm.TqdmDefaultWriteLock())
        tqdm.tqdm.monitor = None
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    warnings.resetwarnings()
    warnings.showwarning = warnings._showwarning_orig  # pytest records warnings instead of printing them
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)  # sys.exit("message"): printed, exit 1
    return 1


def _flushed(code: int) -> int:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not change the exit code
            pass
    return code
