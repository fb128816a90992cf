"""Check the planner against single-GPU measurements: `tools/bench_mfu.py` results vs `hfmeg plan`.

Each bench_mfu JSON line (its hfmeg side: one GPU, TP = PP = DP = 1, bf16, the bench's
LLaMA or, with `--experts`, Mixtral shapes, and recompute mode) is predicted by the planner
as the layout `tp1-pp1-dp1-mbM-<recompute>` (EP = 1: every expert on the one GPU) with
`grad_accum x micro_batch_size` rows per step, on
the profile that `python -m hfmeg.plan calibrate --device cuda` measured on the same GPU.
Memory is compared with `hfmeg_peak_mem_bytes` (`torch.cuda.max_memory_allocated` over
the timed steps, weights and optimizer state included), step time with the timed
tokens per second. Rows of `--trainer-path` runs are skipped: their packed documents
attend within each document, the planner counts causal attention over whole rows.

    python tools/check_plan_gpu.py docs/measurements/h100_bench_mfu.jsonl \\
        --profile docs/measurements/h100_profile.json --gpu h100

One JSON line per row, a table, and a summary JSON line last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from hfmeg.families import model_config_from_hf
from hfmeg.errors import HfmegError
from hfmeg.plan.hardware import ClusterSpec, gpu_spec
from hfmeg.plan.layout import PlanLayout
from hfmeg.plan.profile import load_profile
from hfmeg.plan.search import Job, evaluate
from bench_mfu import hf_config


def check(bench: dict, job_gpu: str, profile) -> dict:
    sh = bench["shapes"]
    rows = sh["grad_accum"] * sh["micro_batch_size"]
    job = Job(model_config_from_hf(hf_config(sh)), ClusterSpec(gpu_spec(job_gpu), 1, 1), profile, rows, sh["seq"], 2)
    ev = evaluate(job, PlanLayout(1, 1, 1, sh["micro_batch_size"], recompute=bench["recompute"]))
    measured_s = rows * sh["seq"] / bench["hfmeg_tokens_per_s"]
    return dict(layers=sh["layers"], hidden=sh["hidden"], experts=sh.get("experts"), top_k=sh.get("top_k"),
                recompute=bench["recompute"], layout=ev.layout.name(),
                predicted_bytes=ev.memory.total, measured_bytes=bench["hfmeg_peak_mem_bytes"],
                memory_error=ev.memory.total / bench["hfmeg_peak_mem_bytes"] - 1,
                predicted_step_s=ev.time.step_s, measured_step_s=measured_s,
                time_error=ev.time.step_s / measured_s - 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", help="file of tools/bench_mfu.py output (its JSON lines are read, the rest skipped)")
    ap.add_argument("--profile", required=True, help="GPU profile from `python -m hfmeg.plan calibrate --device cuda`")
    ap.add_argument("--gpu", required=True, help="GPU kind the results were measured on: a100-40, a100-80, h100, h200")
    a = ap.parse_args(argv)
    try:
        profile = load_profile(a.profile)
        with open(a.results) as f:
            benches = [json.loads(line) for line in f if line.startswith("{") and "hfmeg_tokens_per_s" in line]
        rows = [check(b, a.gpu, profile) for b in benches if not b["trainer_path"]]
    except (HfmegError, OSError, KeyError, json.JSONDecodeError) as e:
        print(f"check_plan_gpu: {a.results}: {e!r}", file=sys.stderr)
        return 2
    if not rows:
        print(f"check_plan_gpu: {a.results} holds no bench_mfu result without --trainer-path", file=sys.stderr)
        return 2
    for r in rows:
        print(json.dumps(r))
    print(f"{'layers':>6} {'hidden':>6} {'experts':>7} {'recompute':<9} {'pred GiB':>9} {'meas GiB':>9} {'err':>7}"
          f" {'pred s':>7} {'meas s':>7} {'err':>7}", file=sys.stderr)
    for r in rows:
        moe = f"{r['top_k']}/{r['experts']}" if r["experts"] else "-"
        print(f"{r['layers']:>6} {r['hidden']:>6} {moe:>7} {r['recompute']:<9} {r['predicted_bytes'] / 2**30:>9.2f}"
              f" {r['measured_bytes'] / 2**30:>9.2f} {r['memory_error']:>+7.1%} {r['predicted_step_s']:>7.3f}"
              f" {r['measured_step_s']:>7.3f} {r['time_error']:>+7.1%}", file=sys.stderr)
    print(json.dumps(dict(rows=len(rows), max_abs_memory_error=max(abs(r["memory_error"]) for r in rows),
                          median_abs_time_error=statistics.median(abs(r["time_error"]) for r in rows),
                          profile=profile.name)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
