"""Check the planner's memory and step-time model against real steps on gloo ranks.

Runs a grid of tiny layouts (TP, SP, PP, VPP, DP, EP, recompute, schedules, optimizer
modes; LLaMA with GQA, LLaMA with MHA and an uneven layer split, GPT-2 with tied
embeddings, Mixtral, Qwen2-MoE with a dense layer and a shared expert) on forked CPU
processes, each for `--steps` training steps after a warm-up step, `--rounds` times
through the whole grid, and prints per layout one JSON line: predicted vs measured
peak bytes of the busiest rank (saved-tensor meter + optimizer buffers and state; with
EP > 1 the measured rank's routing may be off balance) and, when a CPU profile is
given (`--profile`, from `python -m hfmeg.plan calibrate --out FILE`), predicted vs
measured step time (the median of the steps, then of the rounds). A table and a
summary line (max memory error, median time error, whether the fastest predicted
layout is within 10 % of the fastest measured one) follow.

    python tools/check_plan.py --profile cpu_profile.json [--hidden 128 --seq 64]

Step times need a machine with no other load (the profile describes the host the
grid's 1 to 8 ranks share, measured alone); memory figures do not depend on the load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from transformers import GPT2Config, LlamaConfig, MixtralConfig, Qwen2MoeConfig

from hfmeg.families import model_config_from_hf
from hfmeg.errors import HfmegError
from hfmeg.optim.config import OptimizerConfig
from hfmeg.plan.auto import cpu_cluster
from hfmeg.plan.layout import PlanLayout
from hfmeg.plan.measure import Case, measure_cases
from hfmeg.plan.memory import stage_memory
from hfmeg.plan.profile import load_profile
from hfmeg.plan.step_time import step_time


def models(hidden: int, seq: int) -> dict:
    common = dict(hidden_size=hidden, intermediate_size=hidden * 5 // 2, num_attention_heads=8, vocab_size=300,
                  max_position_embeddings=max(128, seq))
    moe = dict(common, intermediate_size=hidden * 3 // 2, num_key_value_heads=4, num_experts_per_tok=2)
    return {
        "mixtral": model_config_from_hf(MixtralConfig(**moe, num_hidden_layers=2, num_local_experts=4)),
        "qwen-moe": model_config_from_hf(Qwen2MoeConfig(**moe, moe_intermediate_size=hidden * 3 // 4,
                                                        shared_expert_intermediate_size=hidden * 5 // 4,
                                                        num_hidden_layers=3, num_experts=4, decoder_sparse_step=2,
                                                        norm_topk_prob=True)),
        "llama-gqa": model_config_from_hf(LlamaConfig(**common, num_hidden_layers=4, num_key_value_heads=4)),
        "llama-mha5": model_config_from_hf(LlamaConfig(**common, num_hidden_layers=5, num_key_value_heads=8)),
        "gpt2-tied": model_config_from_hf(GPT2Config(n_embd=hidden, n_layer=4, n_head=8, vocab_size=300,
                                                     n_positions=max(128, seq))),
    }


# (model, layout, micro-batches per DP rank)
GRID = [
    ("llama-gqa", PlanLayout(1, 1, 1, 2), 2),
    ("llama-gqa", PlanLayout(1, 1, 1, 2, recompute="selective"), 2),
    ("llama-gqa", PlanLayout(1, 1, 1, 2, recompute="full"), 2),
    ("gpt2-tied", PlanLayout(1, 1, 1, 2), 2),
    ("llama-gqa", PlanLayout(2, 1, 1, 2), 2),
    ("llama-gqa", PlanLayout(2, 1, 1, 2, sequence_parallel=False), 2),
    ("llama-gqa", PlanLayout(2, 1, 1, 2, recompute="selective"), 2),
    ("llama-gqa", PlanLayout(1, 2, 1, 2), 4),
    ("llama-gqa", PlanLayout(1, 2, 1, 2, schedule="gpipe"), 4),
    ("llama-gqa", PlanLayout(1, 2, 1, 2, vpp=2), 4),
    ("llama-mha5", PlanLayout(1, 2, 1, 2, recompute="selective"), 4),
    ("llama-gqa", PlanLayout(1, 1, 2, 2), 2),
    ("llama-gqa", PlanLayout(1, 1, 2, 2, optimizer="distributed"), 2),
    ("llama-gqa", PlanLayout(1, 1, 2, 2, optimizer="ddp"), 2),
    ("gpt2-tied", PlanLayout(2, 1, 1, 2, recompute="full"), 2),
    ("llama-gqa", PlanLayout(4, 1, 1, 2), 2),
    ("llama-gqa", PlanLayout(2, 2, 1, 2), 4),
    ("llama-gqa", PlanLayout(1, 2, 2, 2), 4),
    ("llama-gqa", PlanLayout(2, 1, 2, 2, recompute="selective"), 2),
    ("llama-gqa", PlanLayout(1, 4, 1, 1), 8),
    ("llama-gqa", PlanLayout(1, 2, 2, 1, vpp=2, optimizer="distributed"), 4),
    ("gpt2-tied", PlanLayout(2, 2, 1, 1, schedule="gpipe"), 4),
    ("llama-mha5", PlanLayout(2, 2, 2, 1, recompute="full"), 4),
    ("mixtral", PlanLayout(2, 1, 1, 2, sequence_parallel=False, recompute="selective"), 1),
    ("qwen-moe", PlanLayout(1, 2, 1, 1), 4),
    ("mixtral", PlanLayout(1, 1, 2, 2, ep=2), 1),
    ("mixtral", PlanLayout(1, 1, 2, 2, ep=2, recompute="full", optimizer="ddp"), 1),
    ("mixtral", PlanLayout(2, 1, 2, 2, ep=2, recompute="selective"), 1),
    ("qwen-moe", PlanLayout(1, 2, 2, 1, ep=2), 2),
    ("qwen-moe", PlanLayout(1, 1, 4, 1, ep=2, optimizer="distributed"), 1),
]


def run(args) -> list[dict]:
    cfgs = models(args.hidden, args.seq)
    profile = load_profile(args.profile) if args.profile else None
    cases = [Case(cfgs[name], lay, lay.dp * lay.micro_batch * m, args.seq, args.bucket_size, name)
             for name, lay, m in GRID[: args.limit or None]]
    worlds = sorted({c.layout.gpus for c in cases})
    by_world = {w: [c for c in cases if c.layout.gpus == w] for w in worlds}
    # Rounds through all worlds, each case's step time the median over rounds: a burst of other load on
    # the host lands on a few cases of one round, not on every round's.
    rounds = [{w: measure_cases(by_world[w], steps=args.steps, timeout_s=1800) for w in worlds}
              for _ in range(args.rounds)]
    rows = []
    for world in worlds:
        mine = by_world[world]
        for i, (case, per_rank) in enumerate(zip(mine, rounds[0][world])):
            opt = OptimizerConfig(mode=case.layout.optimizer, bucket_size=case.bucket_size)
            worst = max(per_rank, key=lambda r: r["bytes"])
            pred = stage_memory(case.cfg, case.layout, worst["pp_rank"], case.global_batch, case.seq_len, 4, opt)
            row = dict(model=case.label, layout=case.layout.name(), schedule=case.layout.schedule,
                       microbatches=case.layout.microbatches(case.global_batch), ranks=world,
                       global_batch=case.global_batch,
                       measured_bytes=worst["bytes"], predicted_bytes=pred.measurable,
                       memory_error=pred.measurable / worst["bytes"] - 1,
                       measured_step_s=statistics.median(max(r["step_s"] for r in rnd[world][i]) for rnd in rounds))
            if profile is not None:
                t = step_time(case.cfg, case.layout, cpu_cluster(profile, world), profile, case.global_batch,
                              case.seq_len, 4, opt)
                row.update(predicted_step_s=t.step_s, time_error=t.step_s / row["measured_step_s"] - 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def summary(rows: list[dict]) -> dict:
    out = dict(layouts=len(rows), max_abs_memory_error=max(abs(r["memory_error"]) for r in rows))
    timed = [r for r in rows if "time_error" in r]
    if timed:
        out["median_abs_time_error"] = statistics.median(abs(r["time_error"]) for r in timed)
        # "Top choice": among layouts of one job (model, ranks, global batch), the predicted fastest vs the
        # measured fastest.
        job = lambda r: (r["model"], r["ranks"], r["global_batch"])  # noqa: E731
        gaps = []
        for key in {job(r) for r in timed}:
            group = [r for r in timed if job(r) == key]
            if len(group) > 1:
                chosen = min(group, key=lambda r: r["predicted_step_s"])
                gaps.append(chosen["measured_step_s"] / min(r["measured_step_s"] for r in group) - 1)
        out["max_top_choice_gap"] = max(gaps) if gaps else None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", help="CPU profile JSON from `python -m hfmeg.plan calibrate --out FILE`")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per layout (after a warm-up step)")
    ap.add_argument("--rounds", type=int, default=3, help="times through the grid; step time: median over rounds")
    ap.add_argument("--bucket-size", type=int, default=5000, help="small, so buckets straddle and pad")
    ap.add_argument("--limit", type=int, default=0, help="run only the first N layouts of the grid")
    args = ap.parse_args(argv)
    try:
        rows = run(args)
    except HfmegError as e:
        print(f"check_plan: {e}", file=sys.stderr)
        return 2
    print(f"{'model':<11} {'layout':<42} {'sched':<11} {'m':>2} {'pred MiB':>9} {'meas MiB':>9} {'err':>7}"
          f" {'pred s':>8} {'meas s':>8} {'err':>7}", file=sys.stderr)
    for r in rows:
        t = (f" {r['predicted_step_s']:>8.3f} {r['measured_step_s']:>8.3f} {r['time_error']:>+7.1%}"
             if "time_error" in r else f" {'':>8} {r['measured_step_s']:>8.3f}")
        print(f"{r['model']:<11} {r['layout']:<42} {r['schedule']:<11} {r['microbatches']:>2} "
              f"{r['predicted_bytes'] / 2**20:>9.3f} {r['measured_bytes'] / 2**20:>9.3f} {r['memory_error']:>+7.2%}{t}",
              file=sys.stderr)
    print(json.dumps(summary(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
