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

The new workers run this file (`worker` mode) instead of `-m hfmeg`: it notes the clock and the process's CPU time
at each of those points (wrapping the trainer's own functions, nothing else changed) in one file per process
under the run's folder, then runs `hfmeg train` as `-m hfmeg` would. The agents' times come from their log lines
(torch's timestamps), the survivors' line from polling host 0's log. CPU time is summed over the new round's
workers per phase (each between its own marks) and, for the agents, read from /proc at each milestone: it does
not depend on the machine's load, which the wall times do (`uptime` is printed before and after). The job is then
run to its end, and the tool checks that it exits 0 on both hosts.

    sudo .venv/bin/python tools/bench_recovery.py [--kill-after 7] [--restart-after 0] [--runs 1] [--json out.json]

Needs root and `ip netns` (tests/multihost.py), /work/shared/assets (stories260K, the alpaca demo data).
"""

from __future__ import annotations

import argparse
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


# -- worker mode: the new round's processes --------------------------------------------------------------------


class Marks:
    def __init__(self, folder: Path):
        self.path = folder / f"{os.getpid()}.jsonl"
        started = proc_times(os.getpid())
        self.rank, self.restart = int(os.environ.get("RANK", "-1")), os.environ.get("TORCHELASTIC_RESTART_COUNT")
        self.note("spawned", at=started[0], cpu=0.0)
        self.note("interpreter up")

    def note(self, what: str, at: float | None = None, cpu: float | None = None) -> None:
        row = dict(what=what, t=now() if at is None else at, cpu=time.process_time() if cpu is None else cpu,
                   rank=self.rank, pid=os.getpid(), group_rank=os.environ.get("GROUP_RANK"))
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def _after(owner, name: str, marks: Marks, what: str, once: bool = True) -> None:
    """Note `what` each time (or the first time) `owner.name` returns."""
    fn, noted = getattr(owner, name), []

    def wrapped(*args, **kw):
        out = fn(*args, **kw)
        if not (once and noted):
            noted.append(True)
            marks.note(what)
        return out

    setattr(owner, name, wrapped)


def worker(argv: list[str]) -> int:
    marks = Marks(Path(os.environ[MARKS_ENV]))
    import torch  # noqa: F401  (timed on its own: every rank's first import)

    marks.note("torch imported")
    from hfmeg.commands import main as commands
    from hfmeg.train import cli  # noqa: F401  (what `hfmeg train` imports before it runs)
    from hfmeg.train import trainer

    marks.note("hfmeg imported")
    _after(trainer, "join_world", marks, "process group")
    _after(trainer, "check_inputs", marks, "inputs checked")
    _after(trainer, "load_trainer_state", marks, "checkpoint loaded")
    _after(trainer.Trainer, "_read", marks, "first step")
    return commands.main(argv)


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
    from test_multihost_faults import BOUND, FRESH_STORE, SAVE_EVERY, STEPS, _steps

    assets = ROOT.parent / "shared" / "assets" if not args.assets else Path(args.assets)
    out, marks = tmp / "run", tmp / "marks"
    marks.mkdir()
    flags = recipe_flags(assets / "models" / "stories260K", assets / "data" / "alpaca_en_demo.json", out, "--tp",
                         "2", "--save-every", str(SAVE_EVERY), "--keep-last", "2", "--resume", "auto", "--set",
                         f"train.heartbeat_timeout_s={BOUND}", steps=STEPS)
    job = [str(TOOL), "worker", "train", "--recipe", "sft_llama13b", *flags]
    env = {**FRESH_STORE, "LOGLEVEL": "INFO", MARKS_ENV: str(marks)}
    logs = [tmp / "host0.log", tmp / "host1.log", tmp / "host1-again.log"]
    load_before = uptime()
    with Hosts(2) as bed:
        procs = [bed.torchrun(i, 2, job, logs[i], env, max_restarts=3) for i in range(2)]
        wait_for(lambda: _steps(out) > args.kill_after, 300, f"step {args.kill_after + 1}", procs)
        agent0 = procs[0].pid
        victims = bed.pids(1)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        killed, killed_wall = now(), time.time()
        cpu_at: dict[str, dict[int, float]] = {}  # milestone -> {agent pid: CPU seconds}
        agents = [agent0]

        def agent_cpu(what):
            cpu_at[what] = {p: t[1] for p in agents if (t := proc_times(p)) is not None}

        agent_cpu("kill")
        procs[1].wait()
        if args.restart_after:
            time.sleep(args.restart_after)  # the scheduler's delay: part of what is timed, as in the tests
        procs[1] = bed.torchrun(1, 2, job, logs[2], env, max_restarts=3)
        agents.append(procs[1].pid)
        restarted = now() - killed
        line = None
        deadline = killed + 300
        while now() < deadline:
            if line is None and "hfmeg: lost " in logs[0].read_text(errors="replace"):
                line = now() - killed
                agent_cpu("the survivors' line")
            rows = _rows(marks, killed)
            if len({r["pid"] for r in rows if r["what"] == "first step"}) == 4:
                break
            time.sleep(0.05)
        agent_cpu("first step")
        codes = wait_all(procs, 300)
    rows = _rows(marks, killed)
    if codes != [0, 0]:
        tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.is_file())
        raise SystemExit(f"the job did not finish (exit codes {codes}):\n{tails}")
    agent_events = {what: min(log_times(logs[0], mark, killed_wall), default=None) for what, mark in
                    AGENT_MARKS.items()}
    timeline = [("host 1 killed", 0.0)]
    if line is not None:
        timeline.append(("the survivors' line", line))
    timeline.append((f"host 1's torchrun started again ({args.restart_after:g} s wait)", restarted))
    for what, wall in agent_events.items():
        if wall is not None:
            timeline.append((what, wall - killed_wall))
    per_pid: dict[int, dict[str, dict]] = {}
    for r in rows:
        per_pid.setdefault(r["pid"], {})[r["what"]] = r
    workers = [marks_of for marks_of in per_pid.values() if "first step" in marks_of]
    phases = []
    for a, b in zip(WORKER_PHASES, WORKER_PHASES[1:]):
        done = max(m[b]["t"] for m in workers) - killed  # the slowest worker: the collectives wait for it
        cpu = [m[b]["cpu"] - m[a]["cpu"] for m in workers]
        phases.append(dict(phase=f"{a} -> {b}", done_s=round(done, 2), cpu_s=round(sum(cpu), 2),
                           cpu_max_worker_s=round(max(cpu), 2)))
    timeline.append(("new workers spawned (first)", min(m["spawned"]["t"] for m in workers) - killed))
    agent_cpu_s = sum(cpu_at["first step"].get(p, 0.0) - cpu_at["kill"].get(p, 0.0) for p in agents)
    return dict(kill_after=args.kill_after, restart_after=args.restart_after, load_before=load_before,
                load_after=uptime(), timeline=[(w, round(t, 2)) for w, t in sorted(timeline, key=lambda x: x[1])],
                worker_phases=phases, workers=len(workers), agents_cpu_s=round(agent_cpu_s, 2),
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
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        return worker(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kill-after", type=int, default=7, help="kill host 1 once this step is done (default 7)")
    ap.add_argument("--restart-after", type=float, default=0.0,
                    help="seconds from host 1's death to its torchrun started again (default 0)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--assets", help="the assets folder (default: ../shared/assets beside the checkout)")
    ap.add_argument("--json", help="also write every run's result to this file")
    args = ap.parse_args()
    results = []
    for _ in range(args.runs):
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
        print(f"  agents' CPU from the kill to the first step: {result['agents_cpu_s']:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
