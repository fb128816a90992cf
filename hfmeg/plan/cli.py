"""`hfmeg plan` / `python -m hfmeg.plan`: rank layouts, explain one, evaluate one, calibrate, scale.

    python -m hfmeg.plan                                  # the built-in seed-cluster example
    python -m hfmeg.plan --model meta-llama/Llama-2-13b-hf --gpu h100 --gpus 64 --global-batch-size 512 --seq-len 4096
    python -m hfmeg.plan ... --tp 4 --pp 2 --micro-batch-size 1 --recompute selective --json
    python -m hfmeg.plan --model mistralai/Mixtral-8x7B-v0.1 ... --tp 2 --pp 4 --ep 4 --json
    python -m hfmeg.plan ... --explain tp4sp-pp2-dp8-mb1-selective-overlapped
    python -m hfmeg.plan calibrate --out profile.json [--device cuda]
    python -m hfmeg.plan scaling                          # overlapped vs distributed, LLaMA-2-13B, 32..512 GPUs
    python -m hfmeg.plan published                        # predicted vs Megatron-LM's published A100 table

Bad input (unknown GPU, impossible layout, a model that fits nowhere) prints one
line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from ..config import VOCAB_MULTIPLE
from ..errors import HfmegError, LayoutError
from ..parallel.grid import check_world
from ..peft.config import QLORA, PeftConfig, expand_qlora
from . import published, scaling
from .calibrate import calibrate
from .auto import cpu_cluster
from .hardware import GB, GPUS, ClusterSpec, gpu_spec
from .layout import PlanLayout, parse_layout
from .models import resolve_model
from .profile import default_profile, load_profile
from .rollout import VLLM_GPU_MEMORY_UTILIZATION, grpo_terms
from .search import Evaluation, Job, best_layout, evaluate, search
from ..flags import Parser

GIB = 2**30
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
SEED = dict(model="gpt-3.6b", gpu="a100-40", gpus=128, global_batch_size=512, seq_len=1024)


def _job_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", help="built-in name, HF folder, config.json or Hub id (default: the seed example)")
    ap.add_argument("--gpu", help=f"GPU kind: {', '.join(GPUS)} or custom")
    ap.add_argument("--gpus", type=int, help="GPUs in the job")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default: %(default)s)")
    ap.add_argument("--inter-node-gbps", type=float, default=100.0, help="network per node, Gbit/s, all NICs")
    ap.add_argument("--global-batch-size", type=int, help="sequences per optimizer step")
    ap.add_argument("--seq-len", type=int, help="tokens per sequence")
    ap.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="training dtype (default: %(default)s)")
    ap.add_argument("--vocab-multiple", type=int, default=VOCAB_MULTIPLE,
                    help="the run's model.vocab_multiple: the vocabulary is padded to it x TP (default: %(default)s)")
    ap.add_argument("--optimizer", choices=("overlapped", "distributed", "ddp"), default="overlapped",
                    help="optimizer mode (default: %(default)s)")
    ap.add_argument("--profile", help="calibration JSON (default: the GPU kind's assumed profile)")
    ap.add_argument("--peft", choices=("none", "lora", "dora", QLORA), default="none",
                    help="count a LoRA/DoRA run's memory: frozen base, adapters trained; qlora: the base's "
                         "linears 4-bit (NF4) (docs/peft.md)")
    ap.add_argument("--peft-r", type=int, default=8, help="LoRA rank (with --peft)")
    ap.add_argument("--loss-type", choices=("none", "sigmoid", "ipo", "simpo"), default="none",
                    help="a preference run (docs/preference.md): sigmoid and ipo time the reference's forward each "
                         "step and, without --peft, count its frozen copy; simpo has no reference")
    ap.add_argument("--peft-targets", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj"],
                    help="HF projection names or all-linear (with --peft)")
    ap.add_argument("--generator", choices=("transformers", "vllm"),
                    help="a GRPO run (docs/grpo.md) with this generation engine: counts the engine and the weights' "
                         "export folder on global rank 0, and with --beta > 0 the reference as for DPO")
    ap.add_argument("--max-completion-length", type=int, help="GRPO: tokens a completion may have (with --generator)")
    ap.add_argument("--num-generations", type=int, help="GRPO: completions per prompt, a divisor of "
                    "--global-batch-size (with --generator)")
    ap.add_argument("--beta", type=float, default=0.0, help="GRPO: the KL weight; > 0 holds a reference (default: 0)")
    ap.add_argument("--steps-per-generation", type=int, default=1,
                    help="GRPO: optimizer steps one generation batch feeds (default: %(default)s)")
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=VLLM_GPU_MEMORY_UTILIZATION,
                    help="GRPO with --generator vllm on GPUs: the share of rank 0's GPU vLLM reserves "
                         "(default: %(default)s)")
    for flag in ("--peak-tflops", "--memory-gb", "--hbm-gbps", "--nvlink-gbps"):
        ap.add_argument(flag, type=float, help="GPU numbers (required for --gpu custom; override otherwise)")


def _parser(prog: str) -> argparse.ArgumentParser:
    ap = Parser(prog=prog, description=__doc__.split("\n")[0],
                                 epilog=f"other modes, each with --help: {prog} calibrate (measure this machine's "
                                 f"profile), {prog} scaling (overlapped vs distributed optimizer over GPU counts), "
                                 f"{prog} published (predicted vs Megatron-LM's published A100 table)")
    _job_args(ap)
    ap.add_argument("--tp", type=int, help="evaluate this one layout (with --pp, --micro-batch-size ...)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (with --tp)")
    ap.add_argument("--vpp", type=int, default=1, help="virtual pipeline chunks per rank (with --tp)")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (MoE models; a divisor of DP and of "
                    "the expert count)")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel ranks: each sequence split over them (long "
                    "sequences; 2 x CP divides --seq-len)")
    ap.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch (with --tp)")
    ap.add_argument("--recompute", default="none", help="none | selective | full (with --tp)")
    ap.add_argument("--no-sequence-parallel", action="store_true", help="evaluate the layout without sequence "
                    "parallelism (with --tp)")
    ap.add_argument("--fp8", action="store_true", help="the decoder linears in FP8 (model.fp8): their FP8 copies, "
                    "casts and the profile's FP8 GEMM rate (docs/fp8.md)")
    ap.add_argument("--explain", metavar="LAYOUT", help="breakdown of one layout, by the name the table prints")
    ap.add_argument("--json", action="store_true", help="last line: one JSON object")
    ap.add_argument("--top", type=int, default=10, help="rows of the ranked table (default: %(default)s)")
    return ap


def _job(a) -> tuple[Job, list[str]]:
    """The job from the flags; flags left out come from the seed example and are listed."""
    defaulted = []
    for key, value in SEED.items():
        if getattr(a, key, None) is None:
            setattr(a, key, value)
            defaulted.append(key)
    spec = gpu_spec(a.gpu, peak_tflops=a.peak_tflops, memory_gb=a.memory_gb, hbm_gbps=a.hbm_gbps,
                    nvlink_gbps=a.nvlink_gbps)
    link = {"inter_node_bytes_per_s": a.inter_node_gbps * 1e9 / 8}
    prof = load_profile(a.profile) if a.profile else default_profile(a.gpu, spec.peak_flops, spec.hbm_bytes_per_s)
    # A CPU profile: gloo ranks, --gpus-per-node of them to a host, the hosts sharing the machine it measured
    cluster = cpu_cluster(prof, a.gpus, a.gpus_per_node, (a.memory_gb or float("inf")) * GB, **link) if prof.gloo \
        else ClusterSpec(spec, a.gpus, a.gpus_per_node, **link)
    section = dict(method=a.peft, r=a.peft_r, target_modules=a.peft_targets)
    expand_qlora(section)
    peft = PeftConfig(**section)
    peft.check()
    reference = a.loss_type in ("sigmoid", "ipo")
    terms = dict(reference_forward=reference, reference_copy=reference and not peft.enabled)
    if a.generator:
        terms = _grpo_terms(a, peft.enabled)
    return Job(resolve_model(a.model), cluster, prof, a.global_batch_size, a.seq_len, DTYPE_BYTES[a.dtype],
               vocab_multiple=a.vocab_multiple, peft=peft if peft.enabled else None, fp8=a.fp8, **terms), defaulted


def _grpo_terms(a, adapters: bool) -> dict:
    """A GRPO run's `Job` fields from the flags (plan/rollout.py), the flags checked as the run checks its settings."""
    if a.loss_type != "none":
        raise LayoutError(f"--loss-type {a.loss_type} with --generator: a GRPO run has its own loss (no preference "
                          "loss)")
    if a.max_completion_length is None or not 0 < a.max_completion_length < a.seq_len:
        raise LayoutError(f"--max-completion-length {a.max_completion_length}: a GRPO run (--generator) needs one in "
                          f"[1, --seq-len {a.seq_len}), the room its prompts leave")
    if a.num_generations is not None and (a.num_generations < 2 or a.global_batch_size % a.num_generations):
        raise LayoutError(f"--num-generations {a.num_generations}: must be >= 2 and divide --global-batch-size "
                          f"{a.global_batch_size} (the completions of a step)")
    if a.beta < 0 or a.steps_per_generation < 1 or not 0 < a.vllm_gpu_memory_utilization <= 1:
        raise LayoutError(f"--beta {a.beta}, --steps-per-generation {a.steps_per_generation}, "
                          f"--vllm-gpu-memory-utilization {a.vllm_gpu_memory_utilization}: must be >= 0, >= 1 and "
                          "in (0, 1]")
    return grpo_terms(generator=a.generator, beta=a.beta, adapters=adapters, global_batch_size=a.global_batch_size,
                      generation_steps=a.steps_per_generation, seq_len=a.seq_len,
                      max_completion_length=a.max_completion_length,
                      vllm_gpu_memory_utilization=a.vllm_gpu_memory_utilization)


def _row(i, ev: Evaluation) -> str:
    t = ev.time
    return (f"{i:>3} {ev.layout.name():<44} {ev.memory.total / GIB:>8.1f} {t.step_s:>8.3f} "
            f"{t.tokens_per_s_per_gpu:>9.0f} {t.tflops_per_gpu:>7.1f} {t.mfu:>6.1%}")


HEADER = f"{'#':>3} {'layout':<44} {'GiB/GPU':>8} {'step s':>8} {'tok/s/GPU':>9} {'TFLOP/s':>7} {'MFU':>6}"


def _explain(ev: Evaluation) -> None:
    m, t = ev.memory, ev.time
    print(f"{ev.layout.name()}  (schedule {ev.layout.schedule}, stage {m.stage} is the fullest)")
    rollouts = ("rollouts_held", "rollouts_generating") if m.rollouts_held or m.rollouts_host else ()
    for key in ("param_buffer", "grad_buffer", "optimizer_state", "frozen_weights", "activations", "transient",
                *rollouts, "total"):
        print(f"  memory {key:<19} {getattr(m, key) / GIB:>9.2f} GiB")
    if m.rollouts_host:  # a GRPO run's on GPUs: the export folder (and the transformers engine) in host memory
        print(f"  host   rollouts            {m.rollouts_host / GIB:>9.2f} GiB (rank 0's node, beside the GPU's count)")
    for key in ("compute_s", "reference_s", "tp_comm_s", "ep_comm_s", "p2p_s", "bubble_s", "dp_exposed_s", "optimizer_s", "step_s"):
        print(f"  time   {key:<16} {getattr(t, key):>9.4f} s")
    print(f"  {t.tokens_per_s_per_gpu:.0f} tokens/s/GPU, {t.tflops_per_gpu:.1f} TFLOP/s/GPU, MFU {t.mfu:.1%}")


def _plan(a) -> int:
    job, defaulted = _job(a)
    if defaulted:
        print(f"[plan] using the built-in seed example for --{', --'.join(d.replace('_', '-') for d in defaulted)}"
              f" ({job.cluster.nodes} nodes x {job.cluster.gpus_per_node} {job.cluster.gpu.name}, "
              f"{a.inter_node_gbps:g} Gbps between nodes); pass them to plan your own job", file=sys.stderr)
    given = [f"--{k}" for k in ("pp", "vpp", "ep", "cp") if getattr(a, k) != 1]
    if given and not (a.tp or a.explain):
        raise LayoutError(f"{'/'.join(given)} evaluate one layout, with --tp; without --tp the planner searches "
                          "every layout (TP, CP, PP, VPP and, for MoE models, EP)")
    if a.cp < 1:
        raise LayoutError(f"--cp {a.cp}: must be >= 1")
    if a.explain or a.tp:
        lay = parse_layout(a.explain) if a.explain else PlanLayout(
            a.tp, a.pp, check_world(a.gpus, a.tp, a.cp, a.pp), a.micro_batch_size, a.vpp, a.recompute,
            not a.no_sequence_parallel, a.optimizer, ep=a.ep, cp=a.cp)
        lay = replace(lay, vocab_multiple=a.vocab_multiple)
        ev = evaluate(job, lay)
        _explain(ev)
        if a.json:
            print(json.dumps(ev.to_dict()))
        return 0
    fits, reasons, examples = search(job, a.optimizer)
    print(HEADER)
    for i, ev in enumerate(fits[: a.top], 1):
        print(_row(i, ev))
    print(f"{len(fits)} layouts fit; {sum(reasons.values())} rejected:")
    for reason, n in reasons.most_common():
        print(f"  {n:>4} x {reason} (e.g. {examples[reason]})")
    plain = PlanLayout(1, 1, job.cluster.gpus, 1, optimizer=a.optimizer)
    try:
        ev = evaluate(job, plain)
        print(f"plain data parallelism (micro-batch 1):\n{_row('DP', ev)}")
    except HfmegError as e:
        print(f"plain data parallelism ({plain.name()}): {e}")
    if not fits:
        best_layout(job, a.optimizer)  # raises the one-line "fits nowhere" error
    if a.json:
        print(json.dumps(fits[0].to_dict()))
    return 0


def _calibrate(argv, prog: str) -> int:
    ap = Parser(prog=f"{prog} calibrate", description="measure this machine's profile")
    ap.add_argument("--device", default="cpu", help="cpu (gloo links too) or cuda[:N]")
    ap.add_argument("--peak-tflops", type=float, help="reference peak (GPU: its datasheet dense bf16 figure)")
    ap.add_argument("--max-n", type=int, help="largest square matmul")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (default: %(default)s)")
    ap.add_argument("--out", required=True, help="profile JSON to write (pass it to --profile)")
    a = ap.parse_args(argv)
    prof = calibrate(a.device, a.peak_tflops and a.peak_tflops * 1e12, a.max_n, a.repeats)
    prof.save(a.out)
    print(json.dumps({"profile": a.out, "name": prof.name, "peak_flops": prof.peak_flops,
                      "matmul": prof.matmul, "attention_efficiency": prof.attention_efficiency,
                      "memory_bytes_per_s": prof.memory_bytes_per_s, "layer_overhead_s": prof.layer_overhead_s,
                      "links": prof.links}))
    return 0


def main(argv=None, prog: str = "hfmeg plan") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["calibrate"]:
            return _calibrate(argv[1:], prog)
        if argv[:1] == ["scaling"]:
            return scaling.main(argv[1:])
        if argv[:1] == ["published"]:
            return published.main(argv[1:])
        return _plan(_parser(prog).parse_args(argv))
    except HfmegError as e:
        print(f"hfmeg plan: {e}", file=sys.stderr)
        return 2
