"""Kill -9 a training job at chosen moments of its saves and its export; check that nothing is lost.

    python tools/kill_sweep.py                          # every kill point, stories260K on the CPU
    python tools/kill_sweep.py --points export-start,random --seed 3

For each kill point the job (the SFT recipe, fp32, on the CPU) starts in a fresh `--out`, is killed
with SIGKILL (its whole process group) when the point's file appears, and is started again with
the same command (`--resume auto`), which must finish. A point passes when the finished run exits 0,
its exported `hf/` (and, with `--peft lora|dora`, `adapter/`) holds exactly the tensors of an
uninterrupted run's (resume is bit-exact on the CPU), `metrics.jsonl` holds every step once with the
uninterrupted run's losses, bit for bit, `latest` names the final step, and no temporary
folder is left. A point whose file never appeared (the run finished first) is reported as missed.

Points are files the job writes, watched every 2 ms: a checkpoint's temporary folder, its optimizer
shard, its commit (the folder renamed, `latest` not yet rewritten), the final checkpoint, the
export's temporary folder, its weights, the exported folder before its export record, and a
seeded random moment of the run. One JSON line per point, a table, and a last JSON line with the
totals; exit 1 when a point fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT.parent / "shared" / "assets"
RECIPE = ROOT / "recipes" / "sft_llama13b.py"
STEPS, EVERY = 6, 2
# name -> glob under --out whose first match is the moment to kill
POINTS = {
    "save-start": f"checkpoints/.iter_{EVERY * 2:07d}.tmp",
    "save-optim": f"checkpoints/.iter_{EVERY * 2:07d}.tmp/optim/optim_*",
    "save-commit": f"checkpoints/iter_{EVERY * 2:07d}",
    "final-save": f"checkpoints/.iter_{STEPS:07d}.tmp",
    "export-start": ".hf.tmp-*",
    "export-weights": ".hf.tmp-*/*.safetensors",
    "export-record": "hf",
    "random": None,
}


def command(model: Path, data: Path, out: Path, peft: str = "none") -> list[str]:
    return [sys.executable, str(RECIPE), "--model", str(model), "--data", str(data), "--tp", "1", "--seq-len", "64",
            "--global-batch-size", "4", "--max-steps", str(STEPS), "--save-every", str(EVERY), "--keep-last", "2",
            "--eval-every", "0", "--resume", "auto", "--out", str(out), "--dtype", "fp32",
            "--report-to", "none", "--peft", peft]


def run(cmd: list[str], out: Path, *, kill_at: str | None = None, kill_after: float | None = None,
        timeout_s: float = 600) -> tuple[int | None, float]:
    """Run `cmd`; kill its process group when `kill_at` matches under `out` or after `kill_after` s.
    Returns (exit code, None if killed; seconds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    while proc.poll() is None:
        now = time.monotonic() - t0
        if (kill_at and any(out.glob(kill_at))) or (kill_after is not None and now >= kill_after):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None, now
        if now > timeout_s:
            os.killpg(proc.pid, signal.SIGKILL)
            raise TimeoutError(f"{' '.join(cmd)}: no end after {timeout_s:.0f}s")
        time.sleep(0.002)
    stderr = proc.stderr.read()
    if proc.returncode != 0:
        print(stderr, file=sys.stderr)
    return proc.returncode, time.monotonic() - t0


def tensors(hf: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(hf.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def check(out: Path, reference: dict[str, dict[str, torch.Tensor]], ref_losses: list) -> list[str]:
    """What is wrong with a finished run's `out` (empty: nothing); `reference`: the uninterrupted run's
    exported folders (`hf/`, and `adapter/` for a LoRA run) by name."""
    problems = []
    for folder, want in reference.items():
        got = tensors(out / folder) if (out / folder).is_dir() else {}
        if got.keys() != want.keys() or any(not torch.equal(got[k], want[k]) for k in want):
            problems.append(f"{folder}/ differs from the uninterrupted run's")
    steps = [step for step, _ in losses(out)]
    if steps != list(range(1, STEPS + 1)):
        problems.append(f"metrics.jsonl steps {steps}")
    elif losses(out) != ref_losses:
        problems.append("the losses differ from the uninterrupted run's")
    latest = (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip()
    if latest != str(STEPS):
        problems.append(f"latest names {latest}")
    stale = [p.name for p in [*out.glob(".*.tmp*"), *(out / "checkpoints").glob(".*.tmp*")]]
    if stale:
        problems.append(f"left behind: {stale}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ASSETS / "models" / "stories260K", help="HF model folder")
    ap.add_argument("--data", type=Path, default=ASSETS / "data" / "alpaca_en_demo.json", help="SFT data file")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "kill_sweep", help="work folder (replaced)")
    ap.add_argument("--points", default=",".join(POINTS), help=f"comma-separated, of: {', '.join(POINTS)}")
    ap.add_argument("--seed", type=int, default=0, help="seeds the random kill moment")
    ap.add_argument("--peft", default="none", choices=("none", "lora", "dora"),
                    help="a LoRA/DoRA job (its adapter/ is compared too)")
    args = ap.parse_args(argv)
    points = [p for p in args.points.split(",") if p]
    unknown = [p for p in points if p not in POINTS]
    if unknown:
        print(f"error: --points: unknown {unknown[0]!r}; choose from {', '.join(POINTS)}", file=sys.stderr)
        return 2
    for path, flag in ((args.model / "config.json", "--model"), (args.data, "--data")):
        if not path.is_file():
            print(f"error: {path} is absent: pass {flag}", file=sys.stderr)
            return 2
    shutil.rmtree(args.out, ignore_errors=True)
    ref_out = args.out / "reference"
    code, seconds = run(command(args.model, args.data, ref_out, args.peft), ref_out)
    if code != 0:
        print(f"error: the uninterrupted run failed (exit {code})", file=sys.stderr)
        return 1
    reference = {folder: tensors(ref_out / folder) for folder in ("hf", "adapter") if (ref_out / folder).is_dir()}
    ref_losses = losses(ref_out)
    rng = random.Random(args.seed)
    rows = []
    for name in points:
        out = args.out / name
        cmd = command(args.model, args.data, out, args.peft)
        after = rng.uniform(0.1, 0.6) * seconds if POINTS[name] is None else None
        code, at = run(cmd, out, kill_at=POINTS[name], kill_after=after)
        killed = code is None
        if killed:
            code, _ = run(cmd, out)
        problems = ([] if code == 0 else [f"exit {code}"]) + check(out, reference, ref_losses)
        row = dict(point=name, killed=killed, at_s=round(at, 2), ok=not problems,
                   problems=problems)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'point':<16}{'killed at':>10}  result")
    for r in rows:
        when = f"{r['at_s']:.2f}s" if r["killed"] else "missed"
        print(f"{r['point']:<16}{when:>10}  {'ok' if r['ok'] else '; '.join(r['problems'])}")
    failed = [r["point"] for r in rows if not r["ok"]]
    print(json.dumps(dict(points=len(rows), killed=sum(r["killed"] for r in rows), failed=failed,
                          uninterrupted_s=round(seconds, 1))))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
