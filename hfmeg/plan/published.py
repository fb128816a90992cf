"""`hfmeg plan published`: predicted vs published throughput, Megatron-LM's weak-scaling table.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (SC21), Table 1: GPT models (vocabulary 51200, seq 2048, mixed
precision, full activation recompute) on Selene, DGX A100-80GB nodes with eight
200 Gbps HDR InfiniBand NICs each. The paper counts FLOPs with recomputation,
F = 96·B·s·l·h²·(1 + s/6h + V/16lh), and so does this comparison.

Each row is evaluated at its published TP, PP, GPUs and batch as the 2021 runtime ran
it: `ddp` (optimizer state replicated), full recompute, no sequence parallelism (it
came a year later), and the attention core unfused (`step_time`'s `unfused` kernels:
materialised scores, softmax and dropout at memory bandwidth; flash attention came
later too). How that runtime added each micro-batch's gradients into its fp32 main
grads is not modelled: hfmeg's own pass (`step_time`, measured on an H100) is left
out here (`--grad-accumulation` adds it). The planner picks only the micro-batch size
and virtual stages, as a Megatron user would. Memory is counted for hfmeg's own
kernels (it only decides which micro-batches fit).

Calibration, one per GPU kind and stated: the assumed A100 profile's matmul curve is
scaled by the one factor that makes a single held-out row, the largest
(`CALIBRATION_ROW`: the 1008B model, the one whose time is most purely large GEMMs),
come out as published; the other nine rows are predictions, and the median error is
taken over them only. `--uncalibrated` shows the assumed profile as is, `--profile` a
measured A100 profile (used as is). Nothing is tuned per row.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace

from transformers import GPT2Config

from ..families import model_config_from_hf
from ..errors import HfmegError
from .hardware import ClusterSpec, gpu_spec
from .layout import PlanLayout
from .profile import Profile, default_profile, load_profile
from .search import Evaluation, Job, evaluate
from ..flags import Parser

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


CALIBRATION_ROW = -1  # the last (largest) row


def predict(row: tuple, prof: Profile, grad_accumulation: bool = False) -> tuple[Evaluation, float] | None:
    """The fastest micro-batch / virtual-stage choice for `row` and its TFLOP/s per GPU (paper FLOPs), or None."""
    size, heads, h, layers, tp, pp, gpus, batch, _ = row
    spec = gpu_spec("a100-80")
    cfg = model_config_from_hf(GPT2Config(n_embd=h, n_layer=layers, n_head=heads, vocab_size=VOCAB,
                                          n_positions=SEQ))
    job = Job(cfg, ClusterSpec(spec, gpus, 8, inter_node_bytes_per_s=8 * 200e9 / 8), prof, batch, SEQ,
              attention="unfused", grad_accumulation=grad_accumulation)
    dp, best = gpus // (tp * pp), None
    for vpp in (1, 2, 4) if pp > 1 else (1,):
        for mb in (1, 2, 4, 8):
            try:
                ev = evaluate(job, PlanLayout(tp, pp, dp, mb, vpp, "full", False, "ddp"))
            except HfmegError:
                continue
            best = ev if best is None or ev.time.step_s < best.time.step_s else best
    return None if best is None else (best, paper_flops(batch, layers, h) / best.time.step_s / gpus / 1e12)


def scaled(prof: Profile, factor: float) -> Profile:
    return replace(prof, name=f"{prof.name}, matmul x {factor:.3f}",
                   matmul=tuple((f, e * factor) for f, e in prof.matmul))


def calibrate_matmul(prof: Profile, row: tuple, grad_accumulation: bool = False) -> float:
    """The factor on `prof`'s matmul curve that makes `row`'s prediction its published figure (bisection:
    the prediction rises with the factor)."""
    lo, hi = 0.2, 1.0 / max(e for _, e in prof.matmul)
    for _ in range(30):
        mid = (lo + hi) / 2
        got = predict(row, scaled(prof, mid), grad_accumulation)
        if got is None:
            raise HfmegError(f"published: the calibration row ({row[0]}B) fits no micro-batch")
        lo, hi = (mid, hi) if got[1] < row[-1] else (lo, mid)
    return (lo + hi) / 2


def main(argv=None) -> int:
    ap = Parser(prog="hfmeg plan published", description=__doc__.split("\n")[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--profile", help="a measured A100 calibration profile, used as is")
    which.add_argument("--uncalibrated", action="store_true", help="the assumed A100 profile as is")
    ap.add_argument("--grad-accumulation", action="store_true",
                    help="time hfmeg's per-micro-batch pass into the main grads for the 2021 runtime too")
    a = ap.parse_args(argv)
    spec = gpu_spec("a100-80")
    prof = load_profile(a.profile) if a.profile else default_profile("a100-80", spec.peak_flops, spec.hbm_bytes_per_s)
    held_out = None
    if not (a.profile or a.uncalibrated):
        held_out = CALIBRATION_ROW % len(MEGATRON_2021)
        prof = scaled(prof, calibrate_matmul(prof, MEGATRON_2021[held_out], a.grad_accumulation))
    errors = []
    for i, row in enumerate(MEGATRON_2021):
        size, published = row[0], row[-1]
        got = predict(row, prof, a.grad_accumulation)
        if got is None:
            print(json.dumps({"params_b": size, "error": "no micro-batch / vpp fits"}))
            continue
        ev, predicted = got
        out = {"params_b": size, "layout": ev.layout.name(), "published_tflops": published,
               "predicted_tflops": round(predicted, 1), "error": round(predicted / published - 1, 3)}
        if i == held_out:
            out["calibration_row"] = True
        else:
            errors.append(abs(predicted / published - 1))
        print(json.dumps(out))
    print(json.dumps({"rows": len(errors), "median_abs_error": statistics.median(errors) if errors else None,
                      "profile": prof.name}))
    return 0
