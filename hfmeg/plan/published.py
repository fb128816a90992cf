"""`hfmeg plan published`: predicted vs published throughput, Megatron-LM's weak-scaling table.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (SC21), Table 1: GPT models (vocabulary 51200, seq 2048, mixed
precision, full activation recompute) on Selene, DGX A100-80GB nodes with eight
200 Gbps HDR InfiniBand NICs each. The paper counts FLOPs with recomputation,
F = 96·B·s·l·h²·(1 + s/6h + V/16lh), and so does this comparison. Each row is
evaluated at its published TP, PP, GPUs and batch with `ddp` (the paper's
optimizer state is replicated) and full recompute; the planner picks only the
micro-batch size and virtual stages, as a Megatron user would. One profile for
all rows (the assumed A100 one, or `--profile`); nothing is tuned per row.
"""

from __future__ import annotations

import argparse
import json
import statistics

from transformers import GPT2Config

from ..config import model_config_from_hf
from ..errors import HfmegError
from .hardware import ClusterSpec, gpu_spec
from .layout import PlanLayout
from .profile import default_profile, load_profile
from .search import Job, evaluate

# params (B), heads, hidden, layers, TP, PP, GPUs, batch, published TFLOP/s per GPU
MEGATRON_2021 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
SEQ, VOCAB = 2048, 51200


def paper_flops(batch: int, layers: int, hidden: int) -> float:
    return 96 * batch * SEQ * layers * hidden ** 2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="hfmeg plan published", description=__doc__.split("\n")[0])
    ap.add_argument("--profile", help="an A100 calibration profile (default: the assumed one)")
    a = ap.parse_args(argv)
    spec = gpu_spec("a100-80")
    prof = load_profile(a.profile) if a.profile else default_profile("a100-80", spec.peak_flops, spec.hbm_bytes_per_s)
    errors = []
    for size, heads, h, layers, tp, pp, gpus, batch, published in MEGATRON_2021:
        cfg = model_config_from_hf(GPT2Config(n_embd=h, n_layer=layers, n_head=heads, vocab_size=VOCAB,
                                              n_positions=SEQ))
        job = Job(cfg, ClusterSpec(spec, gpus, 8, inter_node_bytes_per_s=8 * 200e9 / 8), prof, batch, SEQ)
        dp, best = gpus // (tp * pp), None
        for vpp in (1, 2, 4) if pp > 1 else (1,):
            for mb in (1, 2, 4, 8):
                try:
                    ev = evaluate(job, PlanLayout(tp, pp, dp, mb, vpp, "full", True, "ddp"))
                except HfmegError:
                    continue
                best = ev if best is None or ev.time.step_s < best.time.step_s else best
        if best is None:
            print(json.dumps({"params_b": size, "error": "no micro-batch / vpp fits"}))
            continue
        predicted = paper_flops(batch, layers, h) / best.time.step_s / gpus / 1e12
        errors.append(abs(predicted / published - 1))
        print(json.dumps({"params_b": size, "layout": best.layout.name(), "published_tflops": published,
                          "predicted_tflops": round(predicted, 1), "error": round(predicted / published - 1, 3)}))
    print(json.dumps({"rows": len(errors), "median_abs_error": statistics.median(errors) if errors else None,
                      "profile": prof.name}))
    return 0
