"""CPU threads on a busy machine: one process's training-like step time, quiet and beside a background load.

Each configuration runs the same workload (forward and backward of a small MLP stack on 512 tokens, the size of
the CPU examples' steps) in a fresh interpreter, so OpenMP reads its settings at start:

- `default`: what a plain `python recipes/...` got before hfmeg set its threads (torch's default: every core,
  OpenMP spinning while it waits);
- `hfmeg`: what hfmeg sets now (`parallel/threads.py`: the cores shared out over the local processes, OpenMP
  waiting passively);
- `one`: `OMP_NUM_THREADS=1`, the issue's workaround.

The load is `--load` busy processes (default: one per core), started before the timed runs and stopped after.
Prints one JSON line per (configuration, load) and a summary line: the loaded/quiet ratio of each.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys

WORKLOAD = """
{setup}
import time, torch
torch.manual_seed(0)
layers = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
x = torch.randn(512, 256)
for _ in range(3):
    layers(x).square().mean().backward()
t0 = time.perf_counter()
for _ in range({steps}):
    layers(x).square().mean().backward()
print(time.perf_counter() - t0)
"""

CONFIGS = {
    "default": ({}, ""),
    "hfmeg": ({}, "from hfmeg.parallel.threads import share_cores; share_cores()"),  # hfmeg first, as recipes
    "one": ({"OMP_NUM_THREADS": "1"}, ""),
}


def _spin() -> None:
    while True:
        pass


def run(name: str, steps: int) -> float:
    env_extra, setup = CONFIGS[name]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env.update(env_extra)
    code = WORKLOAD.format(setup=setup, steps=steps)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--load", type=int, default=len(os.sched_getaffinity(0)), help="busy background processes")
    ap.add_argument("--repeats", type=int, default=3, help="best of this many runs per configuration")
    a = ap.parse_args(argv)
    results: dict[str, dict[str, float]] = {}
    for loaded in (False, True):
        spinners = [mp.Process(target=_spin, daemon=True) for _ in range(a.load if loaded else 0)]
        for p in spinners:
            p.start()
        try:
            for name in CONFIGS:
                best = min(run(name, a.steps) for _ in range(a.repeats))
                results.setdefault(name, {})["loaded" if loaded else "quiet"] = best
                print(json.dumps({"config": name, "load": len(spinners), "seconds": round(best, 3)}), flush=True)
        finally:
            for p in spinners:
                p.terminate()
                p.join()
    print(json.dumps({"bench": "threads", "cores": len(os.sched_getaffinity(0)), "steps": a.steps,
                      "loaded_over_quiet": {k: round(v["loaded"] / v["quiet"], 2) for k, v in results.items()},
                      "seconds": {k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in results.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
