"""Where the seconds of a host-loss recovery go: one timeline, wall and CPU, on the namespace test bed.

Runs the multi-host tests' resumable job (tests/test_multihost_faults.py: TP2 inside a host x DP2 across two
namespace hosts, stories260K, `--save-every 2`, `--resume auto`, `train.heartbeat_timeout_s` 4, `--max-restarts
3`, a store per round) with torchrun's agents at `LOGLEVEL=INFO`, kills all of host 1 (agent and workers, SIGKILL)
after step `--kill-after`, starts host 1's `torchrun` again after `--restart-after` seconds (a scheduler's
requeue; 0: a spare host ready at once), and times, from the kill:

    the survivors' line (hfmeg's heartbeat)  ->  host 0's agent restarting its workers
    -> the next round's rendezvous complete  ->  the new workers spawned
    -> each new worker's imports done -> its process group joined -> its inputs checked
    -> its checkpoint loaded (model and optimizer state) -> its first step finished

The workers run `-m hfmeg train` itself. Every process of the bed starts with a `sitecustomize.py` (written to the
run's folder, first on PYTHONPATH) that has this file note, in each worker, the clock and the process's CPU time
at each of those points, as its imports end and as the trainer's own functions return (wrapped, nothing else
changed), one file per process. The agents' times come from their log lines (torch's timestamps), the survivors'
line from polling host 0's log. CPU time is summed over the new round's workers per phase (each between its own
marks), and for the rest of the bed (the agents) read from /proc at the kill and at the first step: it does not
depend on the machine's load, which the wall times do (the load average is printed before and after). The job
is then run to its end, and the tool checks that it exits 0 on both hosts.

    sudo .venv/bin/python tools/bench_recovery.py [--kill-after 7] [--restart-after 0] [--runs 1] [--json F] [--keep D]

Needs root and `ip netns` (tests/multihost.py), /work/shared/assets (stories260K, the alpaca demo data).
"""

from __future__ import annotations

import argparse
import importlib.abc
import json
import os
import re
import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = Path(__file__).resolve()
MARKS_ENV = "HFMEG_BENCH_MARKS"
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def now() -> float:
    """The clock every process of the bed shares (CLOCK_BOOTTIME: what /proc's start times count in)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def proc_times(pid: int) -> tuple[float, float] | None:
    """(start time on `now`'s clock, CPU seconds so far) of process `pid`, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[19]) * TICK_S, (int(fields[11]) + int(fields[12])) * TICK_S


# -- in the workers: marks noted by the trainer's own functions -------------------------------------------------
#
# Every process of the bed starts with this folder's `sitecustomize.py` on its path (written by `run_once`), which
# calls `instrument()`: it wraps, as each module is imported, the trainer's functions that end a phase. A worker
# notes its marks, its imports' too; the agents note none (no LOCAL_RANK when they start, no trainer function called).


class Marks:
    """This process's marks, one JSON line each in `<folder>/<pid>.jsonl`, the first its start (CPU 0)."""

    def __init__(self, folder: Path):
        self.path = folder / f"{os.getpid()}.jsonl"
        self.pid = os.getpid()
        self.note("spawned", at=proc_times(self.pid)[0], cpu=0.0)

    def note(self, what: str, at: float | None = None, cpu: float | None = None) -> None:
        row = dict(what=what, t=now() if at is None else at, cpu=time.process_time() if cpu is None else cpu,
                   rank=int(os.environ.get("RANK", "-1")), pid=os.getpid())
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


_marks: list[Marks] = []


def note(what: str) -> None:
    """Note `what` in this worker's marks (a forked child starts marks of its own)."""
    if not _marks or _marks[-1].pid != os.getpid():
        _marks.append(Marks(Path(os.environ[MARKS_ENV])))
    _marks[-1].note(what)


def _after(owner, name: str, what: str) -> None:
    """Note `what` the first time `owner.name` returns in a process."""
    fn, noted = getattr(owner, name), set()

    def wrapped(*args, **kw):
        out = fn(*args, **kw)
        if os.getpid() not in noted:
            noted.add(os.getpid())
            note(what)
        return out

    setattr(owner, name, wrapped)


def _instrument_trainer(trainer) -> None:
    _after(trainer, "join_world", "process group")
    _after(trainer, "check_inputs", "inputs checked")
    _after(trainer, "load_trainer_state", "checkpoint loaded")
    _after(trainer.Trainer, "_read", "first step")


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `hooks[name](module)` once module `name` has executed (its import done)."""

    def __init__(self, hooks: dict):
        self.hooks = hooks

    def find_spec(self, name, path, target=None):
        if name not in self.hooks:
            return None
        hook = self.hooks.pop(name)
        spec = next((s for f in sys.meta_path if f is not self and hasattr(f, "find_spec")
                     and (s := f.find_spec(name, path, target)) is not None), None)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                hook(module)

            spec.loader.exec_module = exec_module
        return spec


def instrument() -> None:
    """Called at interpreter start by the bed's sitecustomize.py (see above)."""
    worker = "LOCAL_RANK" in os.environ  # a launcher's worker, not the launcher itself
    if worker:
        note("interpreter up")
    hooks = {"hfmeg.train.trainer": _instrument_trainer}
    if worker:
        hooks.update({"torch": lambda m: note("torch imported"), "hfmeg.train.cli": lambda m: note("hfmeg imported")})
    sys.meta_path.insert(0, _AfterImport(hooks))


SITECUSTOMIZE = """import os, sys
if os.environ.get({env!r}):
    sys.path.insert(0, {tools!r})
    import bench_recovery
    bench_recovery.instrument()
"""


# -- the driver ----------------------------------------------------------------------------------------------------

AGENT_MARKS = {"host 0's agent restarts its workers": "will restart worker group",
               "rendezvous complete": "Rendezvous complete for workers"}
WORKER_PHASES = ["spawned", "interpreter up", "torch imported", "hfmeg imported", "process group", "inputs checked",
                 "checkpoint loaded", "first step"]
LOG_TIME = re.compile(r"^\[?[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d+)")


def log_times(log: Path, mark: str, after_wall: float) -> list[float]:
    """Wall-clock times (epoch seconds) of log lines holding `mark`, stamped by torch's logger, after `after_wall`."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = LOG_TIME.match(line)
        if m and mark in line:
            stamp = datetime.strptime(f"{datetime.now().year}{m.group(1)} {m.group(2)}", "%Y%m%d %H:%M:%S.%f")
            if stamp.timestamp() >= after_wall:
                out.append(stamp.timestamp())
    return out


def uptime() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run_once(args, tmp: Path) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from multihost import Hosts, recipe_flags, wait_all, wait_for
    from test_multihost_faults import BOUND, FRESH_STORE, LOST_LINE, SAVE_EVERY, STEPS, _steps

    assets = ROOT.parent / "shared" / "assets" if not args.assets else Path(args.assets)
    out, marks = tmp / "run", tmp / "marks"
    marks.mkdir()
    flags = recipe_flags(assets / "models" / "stories260K", assets / "data" / "alpaca_en_demo.json", out, "--tp",
                         "2", "--save-every", str(SAVE_EVERY), "--keep-last", "2", "--resume", "auto", "--set",
                         f"train.heartbeat_timeout_s={BOUND}", steps=STEPS)
    job = ["-m", "hfmeg", "train", "--recipe", "sft_llama13b", *flags]
    site = tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(env=MARKS_ENV, tools=str(TOOL.parent)))
    env = {**FRESH_STORE, "LOGLEVEL": "INFO", MARKS_ENV: str(marks), "PYTHONPATH": f"{site}:{ROOT}"}
    logs = [tmp / "host0.log", tmp / "host1.log", tmp / "host1-again.log"]
    load_before = uptime()
    with Hosts(2) as bed:
        procs = [bed.torchrun(i, 2, job, logs[i], env, max_restarts=3) for i in range(2)]
        wait_for(lambda: _steps(out) > args.kill_after, 300, f"step {args.kill_after + 1}", procs)
        for pid in bed.pids(1):
            os.kill(pid, signal.SIGKILL)
        killed, killed_wall = now(), time.time()
        at_kill = {p: proc_times(p) for p in bed.pids(0)}
        lines_before = logs[0].read_text(errors="replace").count(LOST_LINE)  # a line of the first round's start
        procs[1].wait()
        if args.restart_after:
            time.sleep(args.restart_after)  # the scheduler's delay: part of what is timed
        procs[1] = bed.torchrun(1, 2, job, logs[2], env, max_restarts=3)
        restarted = now() - killed
        line = None
        while now() < killed + 300:
            if line is None and logs[0].read_text(errors="replace").count(LOST_LINE) > lines_before:
                line = now() - killed
            if len({r["pid"] for r in _rows(marks, killed) if r["what"] == "first step"}) == 4:
                break
            time.sleep(0.05)
        at_end = {p: proc_times(p) for i in range(2) for p in bed.pids(i)}
        codes = wait_all(procs, 300)
    if codes != [0, 0]:
        tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.is_file())
        raise SystemExit(f"the job did not finish (exit codes {codes}):\n{tails}")
    per_pid: dict[int, dict[str, dict]] = {}
    for r in _rows(marks, killed):
        per_pid.setdefault(r["pid"], {})[r["what"]] = r
    workers = [m for m in per_pid.values() if "first step" in m]
    timeline = [("host 1 killed", 0.0), (f"host 1's launcher started again ({args.restart_after:g} s wait)",
                                         restarted)]
    if line is not None:
        timeline.append(("the survivors' line", line))
    for what, mark in AGENT_MARKS.items():
        stamps = log_times(logs[0], mark, killed_wall)
        if stamps:
            timeline.append((what, min(stamps) - killed_wall))
    # The phases every new worker went through, each ending when the last worker ends it: the collectives that
    # follow wait for the slowest.
    seen = [w for w in WORKER_PHASES if all(w in m for m in workers)]
    phases = []
    for a, b in zip(seen, seen[1:]):
        cpu = [m[b]["cpu"] - m[a]["cpu"] for m in workers]
        phases.append(dict(phase=f"{a} -> {b}", done_s=round(max(m[b]["t"] for m in workers) - killed, 2),
                           cpu_s=round(sum(cpu), 2), cpu_max_worker_s=round(max(cpu), 2)))
    timeline.append(("the new workers spawned (first)", min(m["spawned"]["t"] for m in workers) - killed))
    new_workers = {m["spawned"]["pid"] for m in workers}
    others = sum(t[1] - (at_kill[p][1] if at_kill.get(p) else 0.0) for p, t in at_end.items()
                 if t is not None and p not in new_workers and (p in at_kill or t[0] > killed))
    return dict(kill_after=args.kill_after, restart_after=args.restart_after,
                load_before=load_before, load_after=uptime(),
                timeline=[(w, round(t, 2)) for w, t in sorted(timeline, key=lambda x: x[1])],
                worker_phases=phases, workers=len(workers), workers_cpu_s=round(sum(p["cpu_s"] for p in phases), 2),
                others_cpu_s=round(others, 2),
                first_step_s=round(max(m["first step"]["t"] for m in workers) - killed, 2))


def _rows(folder: Path, after: float) -> list[dict]:
    """The marks of processes started after `after` (the new round's)."""
    rows = []
    for path in folder.glob("*.jsonl"):
        got = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if got and got[0]["what"] == "spawned" and got[0]["t"] > after:
            rows += got
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kill-after", type=int, default=7, help="kill host 1 once this step is done (default 7)")
    ap.add_argument("--restart-after", type=float, default=0.0,
                    help="seconds from host 1's death to its torchrun started again (default 0)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--assets", help="the assets folder (default: ../shared/assets beside the checkout)")
    ap.add_argument("--json", help="also write every run's result to this file")
    ap.add_argument("--keep", help="run in this folder (logs, marks, the run) and keep it, one subfolder a run")
    args = ap.parse_args()
    results = []
    for _ in range(args.runs):
        if args.keep:
            folder = Path(args.keep) / f"run{len(results)}"
            folder.mkdir(parents=True)
            result = run_once(args, folder)
        else:
            with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
                result = run_once(args, Path(tmp))
        results.append(result)
        print(json.dumps(result), flush=True)
        print(f"load {result['load_before']} -> {result['load_after']}")
        for what, t in result["timeline"]:
            print(f"  {t:6.2f} s  {what}")
        for p in result["worker_phases"]:
            print(f"  {p['done_s']:6.2f} s  {p['phase']:<40} CPU {p['cpu_s']:5.2f} s over {result['workers']} "
                  f"workers (max {p['cpu_max_worker_s']:.2f})")
        print(f"  CPU from the kill to the first step: new workers {result['workers_cpu_s']:.2f} s, the rest of the "
              f"bed (agents; not the survivors that exited) {result['others_cpu_s']:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
