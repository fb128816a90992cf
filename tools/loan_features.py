"""The loan's second call (`tools/gpu_loan.py --features`): feature checks, after the speed rows have returned.

Shortest first, each a child process under the smaller of its limit and what is left of `--budget`, one JSON line
in `features.jsonl` per check as it ends (its exit status, time, and the last JSON line the check printed, if any):

- `gpu-tests`: the GPU-marked tests (`pytest -m gpu`);
- `family-*`: tokens/s of a family's own layers against transformers' (tools/bench_mfu.py --family, small shapes,
  packed rows);
- `dpo`: DPO against TRL's DPOTrainer (tools/bench_dpo.py; needs the shared assets, carried as .gpu/assets).

It refuses to start while the speed run (same machine) holds its lock. `--tiny` runs each check at toy shapes on the
CPU (the GPU-marked tests then skip themselves).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time

from gpu_loan import LOCK, REPO, Rows

GPU_TESTS = ["tests/test_gpu.py", "tests/test_attention.py", "tests/test_staging.py",
             "tests/test_linear_cross_entropy.py"]
SMALL = ["--layers", "4", "--hidden", "1024", "--ffn", "2816", "--heads", "16", "--vocab", "32000", "--seq", "2048",
         "--micro-batch-size", "2", "--grad-accum", "1", "--steps", "3", "--warmup", "2", "--trainer-path"]
FAMILIES = {"qwen3": [], "gemma2": ["--set", "sliding_window=512"],
            "gpt_oss": ["--set", "num_local_experts=8", "--set", "sliding_window=512"]}


def checks(tiny: bool) -> list[tuple[str, float, list[str]]]:
    """(name, limit seconds, argv) in the order they run."""
    py = sys.executable
    shapes = ["--tiny", "--layers", "1"] if tiny else SMALL
    out = [("gpu-tests", 240, [py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "gpu",
                               *(GPU_TESTS[:1] if tiny else GPU_TESTS)])]
    for family, extra in FAMILIES.items():
        if tiny and family != "qwen3":
            continue
        out.append((f"family-{family}", 90, [py, "tools/bench_mfu.py", *shapes, "--family", family, *extra]))
    dpo = (["--hidden", "64", "--layers", "1", "--seq", "32", "--rows", "2", "--trl-batch", "1", "--pairs", "4",
            "--steps", "1", "--warmup", "0"] if tiny else
           ["--hidden", "512", "--layers", "4", "--seq", "512", "--rows", "4", "--trl-batch", "2", "--pairs", "64",
            "--steps", "3", "--warmup", "1"])
    out.append(("dpo", 240, [py, "tools/bench_dpo.py", *dpo]))
    return out


def run_features(a) -> int:
    lock = open(LOCK, "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("gpu_loan --features: the speed run is still running on this machine; run it after it returns",
              file=sys.stderr)
        return 2
    rows = Rows(a.out / "features.jsonl", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if a.tiny:
        env["CUDA_VISIBLE_DEVICES"] = ""
    _link_assets()
    end = time.monotonic() + a.budget
    for name, limit, argv in checks(a.tiny):
        left = end - time.monotonic()
        if left < 5:
            rows.write(kind="feature", name=name, status="skipped", reason=f"budget spent ({left:.0f} s left)")
            continue
        t0 = time.monotonic()
        try:
            out = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=min(limit, left))
            status, code, text = ("ok" if out.returncode == 0 else "error"), out.returncode, out.stdout + out.stderr
        except subprocess.TimeoutExpired as e:
            status, code = "timeout", None
            text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(text, end="", flush=True)
        rows.write(kind="feature", name=name, status=status, exitcode=code, seconds=round(time.monotonic() - t0, 2),
                   result=_last_json(text), tail=text.strip().splitlines()[-3:] if status != "ok" else None)
    rows.write(kind="done", out=str(a.out))
    return 0


def _last_json(text: str):
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def _link_assets() -> None:
    """The checks read ../shared/assets; on the device it travels as .gpu/assets."""
    shared, carried = REPO.parent / "shared" / "assets", REPO / ".gpu" / "assets"
    if not shared.exists() and carried.is_dir():
        shared.parent.mkdir(parents=True, exist_ok=True)
        shared.symlink_to(carried)
