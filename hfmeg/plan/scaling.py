"""`hfmeg plan scaling`: the overlapped vs the `distributed` optimizer as the cluster grows.

For each GPU count, the planner's best layout under each optimizer mode, or with
`--tp T [--pp P]` that fixed model-parallel layout with DP = GPUs / (T·P) (same
model, global batch and sequence length: strong scaling), its predicted step time
and tokens/s per GPU, and the scaling efficiency, tokens/s/GPU relative to the
smallest cluster. Defaults: LLaMA-2-13B, H100 nodes of 8 with 4 x 200 Gbps each,
seq 4096, global batch 1024, 32 to 512 GPUs. This is where the overlap's value
shows: DP traffic grows as the per-GPU compute shrinks.
"""

from __future__ import annotations

import json

from .hardware import ClusterSpec, gpu_spec
from .models import resolve_model
from .profile import default_profile, load_profile
from .layout import PlanLayout
from .search import Job, best_layout, evaluate
from ..flags import Parser

MODES = ("overlapped", "distributed")


def main(argv=None) -> int:
    ap = Parser(prog="hfmeg plan scaling", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama2-13b", help="built-in name, HF folder, config.json or Hub id "
                    "(default: %(default)s)")
    ap.add_argument("--gpu", default="h100", help="GPU kind (default: %(default)s)")
    ap.add_argument("--gpus", default="32,64,128,256,512", help="comma-separated GPU counts, one row each "
                    "(default: %(default)s)")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default: %(default)s)")
    ap.add_argument("--inter-node-gbps", type=float, default=4 * 200.0,
                    help="network per node, Gbit/s, all NICs (default: %(default)s)")
    ap.add_argument("--global-batch-size", type=int, default=1024, help="sequences per step (default: %(default)s)")
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default: %(default)s)")
    ap.add_argument("--profile", help="calibration JSON (default: the GPU kind's assumed profile)")
    ap.add_argument("--tp", type=int, help="a fixed layout instead of the best one per mode")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages of the fixed layout (with --tp)")
    ap.add_argument("--micro-batch-size", type=int, default=1, help="micro-batch of the fixed layout (with --tp)")
    ap.add_argument("--recompute", default="selective", help="none | selective | full, of the fixed layout "
                    "(with --tp)")
    a = ap.parse_args(argv)
    cfg, spec = resolve_model(a.model), gpu_spec(a.gpu)
    prof = load_profile(a.profile) if a.profile else default_profile(a.gpu, spec.peak_flops, spec.hbm_bytes_per_s)
    rows, base = [], {}
    for n in (int(x) for x in a.gpus.split(",")):
        cluster = ClusterSpec(spec, n, a.gpus_per_node, inter_node_bytes_per_s=a.inter_node_gbps * 1e9 / 8)
        job = Job(cfg, cluster, prof, a.global_batch_size, a.seq_len)
        row = {"gpus": n}
        for mode in MODES:
            ev = best_layout(job, mode) if a.tp is None else evaluate(job, PlanLayout(
                a.tp, a.pp, n // (a.tp * a.pp), a.micro_batch_size, recompute=a.recompute, optimizer=mode))
            base.setdefault(mode, ev.time.tokens_per_s_per_gpu)
            row[mode] = dict(layout=ev.layout.name(), step_s=ev.time.step_s, dp_exposed_s=ev.time.dp_exposed_s,
                             tokens_per_s_per_gpu=ev.time.tokens_per_s_per_gpu, mfu=ev.time.mfu,
                             scaling_efficiency=ev.time.tokens_per_s_per_gpu / base[mode])
        row["overlapped_vs_distributed"] = row["overlapped"]["step_s"] / row["distributed"]["step_s"]
        rows.append(row)
        print(json.dumps(row))
    print("| GPUs | overlapped: layout | step s | tok/s/GPU | MFU | scaling | distributed: layout | step s | "
          "tok/s/GPU | MFU | scaling | overlapped/distributed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[m]['layout']} | {r[m]['step_s']:.2f} | {r[m]['tokens_per_s_per_gpu']:.0f} | {r[m]['mfu']:.1%} | "
                 f"{r[m]['scaling_efficiency']:.2f}" for m in MODES]
        print(f"| {r['gpus']} | {cells[0]} | {cells[1]} | {r['overlapped_vs_distributed']:.2f} |")
    return 0
