"""A weight gradient into its fp32 main grad: today's two kernels against one fused GEMM.

hfmeg keeps fp32 main grads for bf16 weights. Today autograd computes each micro-batch's
weight gradient as a bf16 GEMM, `g^T x`, and the data-parallel hook adds it into the
fp32 main grad: a second pass over the weight (2 B read, 4 B read, 4 B written per
element) and a rounding of the gradient to bf16 first. Megatron-LM's gradient-
accumulation fusion instead lets the GEMM accumulate into the fp32 buffer:
`torch.addmm(main, g^T, x, out_dtype=torch.float32, out=main)` (CUDA only in torch).
This bench times both per weight gradient at LLaMA-7B/Mixtral shapes (`rows` tokens;
weights fc1 [2F, H] with F = 14336, fc2 [H, F], a square projection) and reports the
fused one's speedup and how far the two results differ, relative to the largest
element (the difference is today's bf16 rounding; the fused result is the exact fp32
sum). One JSON line per shape. Without CUDA it says so and exits 2.

    .venv/bin/python tools/bench_wgrad_fusion.py
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bench_args import at_least

SHAPES = ((1024, 28672, 4096), (4096, 28672, 4096), (4096, 4096, 14336), (16384, 4096, 4096))


def _ms(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def measure(rows: int, out_features: int, in_features: int, steps: int) -> dict:
    dev = torch.device("cuda")
    g = torch.randn(rows, out_features, device=dev, dtype=torch.bfloat16)
    x = torch.randn(rows, in_features, device=dev, dtype=torch.bfloat16)
    main = torch.zeros(out_features, in_features, device=dev, dtype=torch.float32)

    def today():
        main.add_(g.t() @ x)

    def fused():
        torch.addmm(main, g.t(), x, out_dtype=torch.float32, out=main)

    start = main.clone()
    today()
    two_kernels = main - start
    main.copy_(start)
    fused()
    diff = ((main - start - two_kernels).abs().max() / two_kernels.abs().max()).item()
    t_today, t_fused = _ms(today, steps), _ms(fused, steps)
    return dict(device=torch.cuda.get_device_name(), rows=rows, weight=[out_features, in_features],
                gemm_then_add_ms=t_today, fused_ms=t_fused, speedup=t_today / t_fused, max_rel_diff=diff)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=at_least(1), default=20)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_wgrad_fusion: needs a CUDA GPU (torch's addmm with out_dtype runs on CUDA only)", file=sys.stderr)
        return 2
    for shape in SHAPES:
        print(json.dumps(measure(*shape, a.steps)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
