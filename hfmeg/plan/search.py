"""Every layout of a job, evaluated: the ones that fit ranked by step time, the others with a reason.

Candidates: TP a power of two up to the node size (TP stays inside NVLink), PP any
divisor of what is left up to the number of layers, VPP 1/2/4
(interleaved needs layers divisible by PP·VPP, as Megatron asks), micro-batch
1/2/4/8, recompute none/selective/full, SP whenever TP > 1, for MoE models EP
any divisor of DP that also divides the expert count (EP 1 for dense models), and
CP a power of two whose 2·CP chunks keep at least `MIN_CP_CHUNK` tokens (below that
the per-layer K/V all-gather costs more than the split saves), so CP is considered
for long sequences only.
`best_layout` is the call a trainer's `--layout auto` makes.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, replace

from ..config import VOCAB_MULTIPLE, ModelConfig
from ..errors import HfmegError, LayoutError
from ..peft.config import PeftConfig
from .hardware import ClusterSpec
from .layout import PlanLayout, check_layout
from .memory import Memory, stage_memories
from .profile import Profile
from .rollout import RolloutTerms
from .step_time import StepTime, step_time

GIB = 2**30
MIN_CP_CHUNK = 1024  # tokens per chunk of the 2·CP-chunk split the search still tries


@dataclass(frozen=True)
class Evaluation:
    layout: PlanLayout
    memory: Memory
    time: StepTime

    def to_dict(self) -> dict:
        t = self.time
        return dict(layout=self.layout.name(), memory_bytes_per_gpu=self.memory.total, step_s=t.step_s,
                    tokens_per_s_per_gpu=t.tokens_per_s_per_gpu, tflops_per_gpu=t.tflops_per_gpu, mfu=t.mfu,
                    memory=self.memory.to_dict(), time=t.to_dict())


@dataclass(frozen=True)
class Job:
    cfg: ModelConfig
    cluster: ClusterSpec
    profile: Profile
    global_batch: int
    seq_len: int
    dtype_bytes: int = 2
    attention: str = "flash"  # the attention kernels timed (step_time.ATTENTION_KERNELS): hfmeg's are flash
    grad_accumulation: bool = True  # the per-micro-batch pass into the main grads (step_time): hfmeg's runtime
    # LoRA/DoRA: memory counts the adapters as trainable and the base as frozen (memory.py); the step time
    # is still full fine-tuning's (an over-estimate: no base weight gradients are computed)
    peft: PeftConfig | None = None
    # A preference run's reference model (train/parts/reference.py): it runs forward each step (live), and full
    # fine-tuning holds it as a frozen copy
    reference_forward: bool = False
    reference_copy: bool = False
    # A GRPO run's rollouts (plan/rollout.py: its generation engine and the weights' export folder), on global rank 0
    rollouts: RolloutTerms | None = None
    # False: refuse a TP or EP group across nodes, as the trainer does without parallel.allow_cross_host
    # (`--layout auto`); `hfmeg plan` times them over the inter-node link instead
    cross_host: bool = True
    vocab_multiple: int = VOCAB_MULTIPLE  # the run's `model.vocab_multiple` (each layout searched pads by it)
    fp8: bool = False  # the decoder linears in FP8 (`model.fp8`): their casts' copies and time, FP8 GEMM rates


def evaluate(job: Job, lay: PlanLayout) -> Evaluation:
    """Memory and step time of one layout; LayoutError when it cannot run or does not fit."""
    check_layout(job.cfg, lay, job.cluster.gpus, job.global_batch, job.seq_len)
    if not job.cross_host:
        replace(lay.grid, per_host=min(job.cluster.gpus_per_node, job.cluster.gpus)).check_hosts()
    # a CPU profile's ranks attend as on the CPU: dense masks, explicit soft-capped scores
    stages = stage_memories(job.cfg, lay, job.global_batch, job.seq_len, job.dtype_bytes, peft=job.peft,
                            dense_mask=job.profile.gloo, reference_copy=job.reference_copy, fp8=job.fp8,
                            rollouts=job.rollouts, gpu_bytes=None if job.profile.gloo else job.cluster.gpu.memory_bytes)
    mem = max(stages, key=lambda m: m.total)
    if mem.total > job.cluster.usable_memory:
        raise LayoutError(f"out of memory: needs {mem.total / GIB:.1f} GiB per GPU, "
                          f"{job.cluster.usable_memory / GIB:.1f} GiB usable")
    return Evaluation(lay, mem, step_time(job.cfg, lay, job.cluster, job.profile, job.global_batch, job.seq_len,
                                          job.dtype_bytes, memories=stages, attention=job.attention,
                                          grad_accumulation=job.grad_accumulation,
                                          reference_forward=job.reference_forward, fp8=job.fp8,
                                          base_4bit=job.peft is not None and job.peft.quantize is not None))


def expert_parallel_sizes(cfg: ModelConfig, dp: int) -> list[int]:
    """The EP sizes a layout with `dp` data-parallel ranks can take: divisors of DP and of the expert count."""
    experts = cfg.moe.num_experts if cfg.moe else 1
    return [e for e in range(1, dp + 1) if dp % e == 0 and experts % e == 0]


def context_parallel_sizes(job: Job, tp: int) -> list[int]:
    """The CP sizes the search tries beside TP `tp`: powers of two dividing the rest of the GPUs, whose
    2·CP equal chunks of a row hold at least MIN_CP_CHUNK tokens each."""
    out, cp = [1], 2
    while (job.cluster.gpus // tp) % cp == 0 and job.seq_len % (2 * cp) == 0 \
            and job.seq_len // (2 * cp) >= MIN_CP_CHUNK:
        out.append(cp)
        cp *= 2
    return out


def candidates(job: Job, optimizer: str = "overlapped") -> list[PlanLayout]:
    gpus, node = job.cluster.gpus, min(job.cluster.gpus_per_node, job.cluster.gpus)
    out = []
    tp = 1
    while tp <= node:
        for cp in context_parallel_sizes(job, tp):
            rest = gpus // (tp * cp)
            for pp in (p for p in range(1, rest + 1) if rest % p == 0 and p <= job.cfg.num_layers):
                dp = rest // pp
                for vpp in (1, 2, 4) if pp > 1 else (1,):
                    if vpp > 1 and job.cfg.num_layers % (pp * vpp):
                        continue
                    for ep in expert_parallel_sizes(job.cfg, dp):
                        for mb in (1, 2, 4, 8):
                            for rec in ("none", "selective", "full"):
                                out.append(PlanLayout(tp, pp, dp, mb, vpp, rec, True, optimizer, ep=ep, cp=cp,
                                                      vocab_multiple=job.vocab_multiple))
        tp *= 2
    return out


def _rule(message: str) -> str:
    """The rule a rejection states, without its numbers, so that one rule is one reason:
    "global batch 6 is not divisible by DP x micro-batch = 4 x 1" -> "global batch is not divisible by DP x
    micro-batch" (`search` keeps one case with its numbers beside it)."""
    for numbers in (r" = \d+( x \d+)*", r" \(\d+\)", r" \d+\b"):
        message = re.sub(numbers, "", message)
    return message


def search(job: Job, optimizer: str = "overlapped") -> tuple[list[Evaluation], Counter, dict[str, str]]:
    """(fitting layouts, fastest first; rejection counts by reason; one example layout per reason)."""
    fits, reasons, examples = [], Counter(), {}
    for lay in candidates(job, optimizer):
        try:
            fits.append(evaluate(job, lay))
        except HfmegError as e:
            reason = _rule(str(e).split(":")[0])
            reasons[reason] += 1
            examples.setdefault(reason, f"{lay.name()}: {e}")
    fits.sort(key=lambda ev: ev.time.step_s)
    return fits, reasons, examples


def best_layout(job: Job, optimizer: str = "overlapped") -> Evaluation:
    """The fastest layout that fits; LayoutError (one line) when none does."""
    fits, reasons, examples = search(job, optimizer)
    if not fits:
        oom = examples.get("out of memory", "")  # the key `search` gives every OOM
        raise LayoutError(f"the model fits no layout on {job.cluster.gpus} x {job.cluster.gpu.name}"
                          + (f" (e.g. {oom})" if oom else "")
                          + f"; {sum(reasons.values())} layouts rejected")
    return fits[0]
