"""CPU threads on a busy machine: one process's training-like step time, quiet and beside a background load.

Each configuration runs the same workload (forward and backward of a small MLP stack on 512 tokens, the size of
the CPU examples' steps) in a fresh interpreter, so OpenMP reads its settings at start:

- `default`: what a plain `python recipes/...` got before hfmeg set its threads (torch's default: every core,
  OpenMP spinning while it waits);
- `hfmeg`: what hfmeg sets (`parallel/threads.py`): its share of the cores, re-chosen before every step as the
  trainer does (`threads.rebalance`);
- `cores`: every core this process may use (`os.sched_getaffinity`), OpenMP waiting passively;
- `cores-minus-load`: those cores less the other runnable tasks seen at start (`/proc/loadavg`'s running
  count, less this process), at least one, waiting passively;
- `one`: one thread (`OMP_NUM_THREADS=1`, the issue's workaround);
- `twice-cores`: two threads per core, waiting passively (more of the kernel's per-thread shares when others
  compete in the same session).

The load is `--load` busy processes (default: one per core), started before the timed runs and stopped after:
`--load-session same` runs them in the bench's own session (the kernel's fair share is then per thread),
`other` in a session of their own (with the kernel's autogroup on, the default of most distributions, a
session is shared out as a group: a busy machine's other jobs). The configurations run in turn, round after
round (`--repeats`), and each one's median counts, so that a machine whose own load drifts weighs on each
alike. Prints one JSON line per (configuration, load) and a summary line: each configuration's loaded time over
the best quiet time of all (what a user compares: their run on a quiet machine against the same run on a busy
one), and over its own quiet time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys

WORKLOAD = """
{setup}
import time, torch
torch.manual_seed(0)
layers = torch.nn.Sequential(*[torch.nn.Linear({width}, {width}) for _ in range(8)])
x = torch.randn(512, {width})
for _ in range(3):
    layers(x).square().mean().backward()
t0 = time.perf_counter()
for _ in range({steps}):
    {per_step}
    layers(x).square().mean().backward()
print(time.perf_counter() - t0)
"""

PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}
_CORES = "import os; cores = len(os.sched_getaffinity(0))"
_OTHERS = "others = max(0, int(open('/proc/loadavg').read().split()[3].split('/')[0]) - 1)"
# name: (environment, set-up code, code run before each step)
CONFIGS = {
    "default": ({}, "", ""),
    # hfmeg imported first, as the recipes do
    "hfmeg": ({}, "from hfmeg.parallel import threads; threads.share_cores()", "threads.rebalance()"),
    "cores": (PASSIVE, f"{_CORES}; import torch; torch.set_num_threads(cores)", ""),
    "cores-minus-load": (PASSIVE, f"{_CORES}; {_OTHERS}; import torch; torch.set_num_threads(max(1, cores - others))",
                         ""),
    "one": ({**PASSIVE, "OMP_NUM_THREADS": "1"}, "", ""),
    "twice-cores": (PASSIVE, f"{_CORES}; import torch; torch.set_num_threads(2 * cores)", ""),
}


def _spin(own_session: bool) -> None:
    if own_session:
        os.setsid()
    while True:
        pass


def run(name: str, steps: int, width: int) -> float:
    env_extra, setup, per_step = CONFIGS[name]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env.update(env_extra)
    code = WORKLOAD.format(setup=setup, steps=steps, per_step=per_step or "pass", width=width)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--width", type=int, default=256,
                    help="the MLP's width: 256 is the CPU examples' step, 1024 or more a step that two threads halve")
    ap.add_argument("--load", type=int, default=len(os.sched_getaffinity(0)), help="busy background processes")
    ap.add_argument("--load-session", choices=("same", "other"), default="same",
                    help="the load in the bench's session or in one of its own")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; the median of each configuration's runs")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of: " + ", ".join(CONFIGS))
    a = ap.parse_args(argv)
    names = a.configs.split(",")
    results: dict[str, dict[str, float]] = {}
    for loaded in (False, True):
        spinners = [mp.Process(target=_spin, args=(a.load_session == "other",), daemon=True)
                    for _ in range(a.load if loaded else 0)]
        for p in spinners:
            p.start()
        try:
            # Rounds of every configuration in turn, so that a machine whose own load drifts (others' jobs) weighs on
            # each alike; the median of the rounds.
            times: dict[str, list[float]] = {name: [] for name in names}
            for _ in range(a.repeats):
                for name in names:
                    times[name].append(run(name, a.steps, a.width))
            for name, seconds in times.items():
                results.setdefault(name, {})["loaded" if loaded else "quiet"] = statistics.median(seconds)
                print(json.dumps({"config": name, "load": len(spinners), "seconds": [round(t, 3) for t in seconds],
                                  "loadavg": os.getloadavg()[0]}), flush=True)
        finally:
            for p in spinners:
                p.terminate()
                p.join()
    best_quiet = min(v["quiet"] for v in results.values())
    print(json.dumps({"bench": "threads", "cores": len(os.sched_getaffinity(0)), "steps": a.steps, "width": a.width,
                      "load": a.load, "load_session": a.load_session, "loadavg_at_end": os.getloadavg(),
                      "loaded_over_best_quiet": {k: round(v["loaded"] / best_quiet, 2) for k, v in results.items()},
                      "loaded_over_quiet": {k: round(v["loaded"] / v["quiet"], 2) for k, v in results.items()},
                      "seconds": {k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in results.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
