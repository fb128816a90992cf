"""`Profile`: what a device really achieves, measured by `hfmeg plan calibrate` or assumed.

The step-time model needs four numbers the datasheet does not give: the fraction
of peak a matmul of a given size reaches (a curve, by FLOPs per matmul), the same
for the attention core, the streaming memory bandwidth (elementwise kernels,
the optimizer update), fixed costs per decoder layer, for the model's two ends and per gradient bucket
(Python, autograd and launches, which dominate small models), and how much of a
link's bandwidth collectives reach, with their latency.

A CPU profile is per rank (one intra-op thread, as spawned gloo ranks run) and
says how many ranks compute at once (`cores`); its gloo links are measured with
2, 4, 8, ... ranks on the host, every pair exchanging at once (`links`), because
ranks that outnumber the cores wait for the scheduler at every message, and so is
how much slower each of them computes than one rank alone (`slowdown`).

A calibrated profile is a JSON file (`Profile.save` / `load_profile`). The shipped
GPU profiles are assumptions, not measurements (no GPU was lent to calibrate):
cuBLAS bf16 GEMM efficiency curves of the usual shape, FlashAttention-2 at half of
peak on the causal half of the attention FLOPs, NCCL at 80 % of link bandwidth.
Running `hfmeg plan calibrate` on the GPU replaces them.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import UnsupportedConfigError


@dataclass(frozen=True)
class Profile:
    name: str
    peak_flops: float  # the reference the efficiencies are fractions of
    matmul: tuple[tuple[float, float], ...]  # (FLOPs of one matmul, fraction of peak), ascending FLOPs
    attention_efficiency: float  # fraction of peak on the causal attention FLOPs (half of Megatron's count)
    memory_bytes_per_s: float
    layer_overhead_s: float  # fixed cost of one decoder layer's forward + backward (Python, autograd, launches)
    ends_overhead_s: float  # fixed cost of the embedding + LM head + loss of one micro-batch, forward + backward
    bucket_overhead_s: float  # fixed cost of one gradient bucket per step (hooks, AdamW call, collective launches)
    link_efficiency: float = 0.8  # fraction of the cluster's link bandwidth collectives reach
    # measured (calibrate, CPU): (ranks on the host, bytes/s, latency) of a gloo pair while that many
    # ranks exchange at once, ascending ranks; replaces the cluster's links
    links: tuple[tuple[int, float, float], ...] = ()
    cores: int | None = None  # CPU profiles: ranks beyond this many share the cores
    # fixed cost of an MoE layer's forward + backward beside its experts' (router, dispatch, attention), and
    # of each expert it holds; None: MoE layers cost `layer_overhead_s` as dense ones (the assumed profiles)
    moe_layer_overhead_s: float | None = None
    expert_overhead_s: float = 0.0
    # what re-running a layer in backward costs beyond its compute under selective / full recompute, as a
    # fraction of the layer's fixed cost (the defaults, the assumed profiles': nothing, the forward's third)
    selective_recompute_fixed: float = 0.0
    full_recompute_fixed: float = 1 / 3
    # measured (calibrate, CPU): (ranks on the host, how many times slower each computes than one alone)
    slowdown: tuple[tuple[int, float], ...] = ()
    # TP collectives' cost with sequence parallelism over without (gloo runs each all-gather and
    # reduce-scatter as a collective with its own fixed costs); 1: the same bytes and latencies
    sequence_parallel_comm: float = 1.0
    # fixed costs of the pipeline executor around the chunks' own forward + backward: per micro-batch and
    # chunk (loss, schedule, hooks), and per step (the optimizer's call, the loss's and norm's reductions)
    microbatch_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    # `model.fp8`: FP8 GEMMs' throughput over the model dtype's at the same shapes (torch._scaled_mm); 1: no FP8
    # GEMM (CPUs emulate FP8 in fp32 products: the GEMMs cost what they did, the casts come on top)
    fp8_matmul_speedup: float = 1.0
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def gloo(self) -> bool:
        """A CPU profile: its ranks talk over gloo, where every collective pays its latencies (each
        bucket's, the embedding's and the loss's too) and none hides behind compute."""
        return self.cores is not None

    def layer_fixed_s(self, experts: int | None) -> float:
        """Fixed cost of one decoder layer's forward + backward: dense (`experts` None), or MoE holding
        `experts` experts."""
        if experts is None or self.moe_layer_overhead_s is None:
            return self.layer_overhead_s
        return self.moe_layer_overhead_s + experts * self.expert_overhead_s

    def compute_slowdown(self, ranks: int) -> float:
        """How many times slower each of `ranks` CPU ranks on the host computes than one alone: measured
        (the measurement with the most ranks not above `ranks`, scaled by the ranks beyond it), else
        ranks/cores once they outnumber the cores; 1 for one rank and on a GPU."""
        if self.cores is None or ranks <= 1:
            return 1.0
        below = [x for x in self.slowdown if x[0] <= ranks]
        if not below:
            return max(1.0, ranks / self.cores)
        measured_ranks, factor = below[-1]
        return factor * max(1.0, ranks / max(measured_ranks, self.cores))

    def link(self, ranks: int) -> tuple[float, float] | None:
        """(bytes/s, latency) of the measured link with `ranks` ranks on the host: the measurement with
        the most ranks not above `ranks` (the fewest when all are above); None when not measured."""
        if not self.links:
            return None
        below = [x for x in self.links if x[0] <= ranks] or self.links[:1]
        return below[-1][1], below[-1][2]

    def efficiency(self, flops: float) -> float:
        """Fraction of peak at `flops` per matmul, log-linear between calibrated points."""
        xs = [math.log(f) for f, _ in self.matmul]
        x = math.log(max(flops, 1.0))
        i = bisect.bisect_left(xs, x)
        if i == 0:
            return self.matmul[0][1] * flops / self.matmul[0][0]  # below the curve: a fixed cost dominates
        if i == len(xs):
            return self.matmul[-1][1]
        (x0, y0), (x1, y1) = (xs[i - 1], self.matmul[i - 1][1]), (xs[i], self.matmul[i][1])
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))


def load_profile(path: str | Path) -> Profile:
    try:
        raw = json.loads(Path(path).read_text())
        raw["matmul"] = tuple(tuple(p) for p in raw["matmul"])
        # profiles written before `links`: one gloo link, measured with two ranks
        bw, lat = raw.pop("link_bytes_per_s", None), raw.pop("link_latency_s", None)
        raw["links"] = tuple(tuple(x) for x in raw.get("links", ())) or (((2, bw, lat or 0.0),) if bw else ())
        raw["slowdown"] = tuple(tuple(x) for x in raw.get("slowdown", ()))
        return Profile(**raw)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise UnsupportedConfigError(f"{path}: not a calibration profile ({type(e).__name__}: {e})") from e


_A100_CURVE = ((1e8, 0.10), (1e9, 0.35), (1e10, 0.62), (1e11, 0.78), (1e12, 0.85))
_HOPPER_CURVE = ((1e8, 0.05), (1e9, 0.18), (1e10, 0.45), (1e11, 0.66), (1e12, 0.75))

ASSUMED: dict[str, Profile] = {
    "a100-40": Profile("a100 (assumed)", 312e12, _A100_CURVE, 0.5, 1.3e12, 2e-4, 1e-4, 1e-4),
    "a100-80": Profile("a100 (assumed)", 312e12, _A100_CURVE, 0.5, 1.7e12, 2e-4, 1e-4, 1e-4),
    # FP8: the datasheet's dense ratio (1979 / 989 TFLOP/s) until a loan measures it (tools/gpu_loan.py row4)
    "h100": Profile("h100 (assumed)", 989e12, _HOPPER_CURVE, 0.45, 2.8e12, 2e-4, 1e-4, 1e-4, fp8_matmul_speedup=2.0),
    "h200": Profile("h200 (assumed)", 989e12, _HOPPER_CURVE, 0.45, 4.0e12, 2e-4, 1e-4, 1e-4, fp8_matmul_speedup=2.0),
}


def default_profile(kind: str, peak_flops: float, hbm_bytes_per_s: float) -> Profile:
    """The assumed profile of a shipped GPU kind; a custom GPU borrows the Hopper curve at its own peak."""
    if kind in ASSUMED:
        return ASSUMED[kind]
    return Profile(f"{kind} (assumed)", peak_flops, _HOPPER_CURVE, 0.45, 0.83 * hbm_bytes_per_s, 2e-4, 1e-4, 1e-4)
