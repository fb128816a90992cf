"""Check the planner's step time against runs across namespace hosts over shaped links.

Runs TP2 x DP2 on 2 hosts x 2 ranks and PP2 x DP2 on 4 hosts x 1 rank on the namespace test bed
(tests/multihost.py: 1 Gbit/s tbf links; root and `ip netns`), each beside the same layout on one host, for a
random LLaMA large enough that the DP gradient reduction over the link is a visible part of the step. A run's
step time is the median over its steps after `--warmup` (rank 0's clock, from metrics.jsonl), then over
`--rounds`; the prediction is `hfmeg plan`'s for the run's own layout (read back from its config.yaml) with
`--gpus-per-node` ranks to a host and the link's rate (`cpu_cluster`). Before the runs it probes what the shaped
link really carries between gloo ranks (one pair, then two pairs at once, 8 MiB messages), and each prediction
is given again at that rate. Prints one JSON line per run and a table.

    hfmeg plan calibrate --out cpu.json && python tools/check_plan_hosts.py --profile cpu.json [--rounds 3]

The CPU profile describes the machine all the namespace hosts share (every rank computes at the slowdown of
the job's whole world on its cores); step times need that machine without other load.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, LlamaConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the namespace test bed

from multihost import RATE, Hosts, run_job, train_args, wait_all  # noqa: E402

from hfmeg.optim.config import OptimizerConfig  # noqa: E402
from hfmeg.plan.auto import cpu_cluster  # noqa: E402
from hfmeg.plan.layout import PlanLayout  # noqa: E402
from hfmeg.plan.models import resolve_model  # noqa: E402
from hfmeg.plan.profile import load_profile  # noqa: E402
from hfmeg.plan.step_time import step_time  # noqa: E402
from hfmeg.train.metrics import read_metrics  # noqa: E402

ASSETS = ROOT.parent / "shared" / "assets"
TOKENIZER_FROM = ASSETS / "models" / "stories260K"
DATA = ASSETS / "data" / "alpaca_en_demo.json"
LINK_BYTES_PER_S = 1e9 / 8  # multihost.RATE
# (hosts, ranks per host, layout flags)
CASES = [(2, 2, ("--tp", "2")), (4, 1, ("--tp", "1", "--pp", "2"))]


def make_model(folder: Path, hidden: int, layers: int) -> int:
    """A random LLaMA of `hidden` x `layers` with stories260K's tokenizer (and vocabulary); its parameter count."""
    cfg = LlamaConfig.from_pretrained(TOKENIZER_FROM)
    cfg.update(dict(hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64, num_hidden_layers=layers,
                    num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_FROM / name, folder / name)
    return sum(p.numel() for p in model.parameters())


PROBE_BYTES = 8 * 2**20


def probe_worker(rank: int, world: int, head: str) -> None:
    """One rank of the link probe: exchange PROBE_BYTES with the rank half the world away (on the other host),
    five times after a warm-up; print bytes/s each way."""
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{head}:29511", rank=rank, world_size=world)
    peer, x = (rank + world // 2) % world, torch.ones(PROBE_BYTES // 4)
    y = torch.empty_like(x)

    def exchange():
        for work in (dist.isend(x, peer), dist.irecv(y, peer)):
            work.wait()

    exchange()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(5):
        exchange()
    print(json.dumps({"bytes_per_s": 5 * PROBE_BYTES / (time.perf_counter() - t0)}), flush=True)
    dist.destroy_process_group()


def probe_link(work: Path, pairs: int) -> float:
    """Bytes/s one way that `pairs` gloo pairs, all at once, get between two namespace hosts: their sum."""
    logs = [work / f"probe{pairs}-{r}.log" for r in range(2 * pairs)]
    with Hosts(2) as bed:
        procs = [bed.popen(r // pairs, [sys.executable, __file__, "--probe-worker", str(r), str(2 * pairs),
                                        bed.addr(0)], logs[r]) for r in range(2 * pairs)]
        if wait_all(procs, 120) != [0] * len(procs):
            raise RuntimeError("the link probe failed:\n" + "\n".join(log.read_text()[-2000:] for log in logs))
    rates = [json.loads(log.read_text().strip().splitlines()[-1])["bytes_per_s"] for log in logs]
    return sum(rates) / 2


def measured_step_s(out: Path, warmup: int) -> list[float]:
    """Rank 0's step times after `warmup` steps: the trainer logs tokens/s of a global batch of full rows."""
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "tokens_per_s" in r]
    c = yaml.safe_load((out / "config.yaml").read_text())
    tokens = c["train"]["global_batch_size"] * c["data"]["seq_len"]
    return [tokens / r["tokens_per_s"] for r in rows[warmup:]]


def predicted(out: Path, world: int, per_host: int, profile, link_bytes_per_s: float = LINK_BYTES_PER_S):
    """`hfmeg plan`'s step time for the run in `out`, `per_host` ranks to a host over a link of that rate."""
    c = yaml.safe_load((out / "config.yaml").read_text())
    par, opt, train = c["parallel"], c["optim"], c["train"]
    dp = world // (par["tp"] * par["pp"] * par["cp"])
    lay = PlanLayout(par["tp"], par["pp"], dp, train["micro_batch_size"], par["vpp"], c["model"]["recompute"],
                     par["sequence_parallel"], opt["mode"], par["schedule"], par["ep"], par["cp"])
    optc = OptimizerConfig(mode=opt["mode"], bucket_size=opt["bucket_size"],
                           grad_accumulation_fusion=opt["grad_accumulation_fusion"])
    cluster = cpu_cluster(profile, world, per_host, inter_node_bytes_per_s=link_bytes_per_s)
    return lay, step_time(resolve_model(c["model"]["path"]), lay, cluster, profile, train["global_batch_size"],
                          c["data"]["seq_len"], 4, optc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", help="CPU profile JSON from `hfmeg plan calibrate --out FILE` (required)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4, help="steps left out of the median")
    ap.add_argument("--rounds", type=int, default=1, help="times through the runs; step time: median over rounds")
    ap.add_argument("--probe-worker", nargs=3, help=argparse.SUPPRESS)  # RANK WORLD HEAD: one rank of the probe
    a = ap.parse_args(argv)
    if a.probe_worker:
        probe_worker(int(a.probe_worker[0]), int(a.probe_worker[1]), a.probe_worker[2])
        return 0
    if not a.profile:
        ap.error("--profile is required")
    profile = load_profile(a.profile)
    work = Path(tempfile.mkdtemp(prefix="check_plan_hosts-"))
    links = {pairs: probe_link(work, pairs) for pairs in (1, 2)}
    print(json.dumps({"link_bytes_per_s_one_pair": links[1], "link_bytes_per_s_two_pairs": links[2],
                      "nominal_bytes_per_s": LINK_BYTES_PER_S}), flush=True)
    params = make_model(work / "model", a.hidden, a.layers)
    print(f"random LLaMA {a.hidden} x {a.layers}: {params / 1e6:.2f} M parameters; links {RATE} (tbf)",
          file=sys.stderr)
    times: dict = {}
    for rnd in range(a.rounds):
        for hosts, per_host, flags in CASES:
            world = hosts * per_host
            for n, ph in ((1, world), (hosts, per_host)):
                out = work / f"r{rnd}-{n}x{ph}-{'-'.join(flags)}"
                with Hosts(n) as bed:
                    run_job(bed, ph, train_args(work / "model", DATA, out, *flags, steps=a.warmup + a.steps),
                            work / "logs" / out.name, timeout_s=600)
                times.setdefault((n, ph, flags), []).append((statistics.median(measured_step_s(out, a.warmup)), out))
    rows = []
    for (n, ph, flags), runs in times.items():
        lay, t = predicted(runs[0][1], n * ph, ph, profile)
        # the same at the rate the probe measured with as many pairs crossing as this layout's host has ranks
        probed = predicted(runs[0][1], n * ph, ph, profile, links[ph])[1].step_s if n > 1 else t.step_s
        meas = statistics.median(s for s, _ in runs)
        row = dict(hosts=n, per_host=ph, layout=lay.name(), measured_step_s=meas, rounds=[s for s, _ in runs],
                   predicted_step_s=t.step_s, predicted_dp_s=t.dp_exposed_s, predicted_p2p_s=t.p2p_s + t.bubble_s,
                   error=t.step_s / meas - 1, predicted_at_probed_link_s=probed, error_at_probed_link=probed / meas - 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"{'hosts':>5} {'layout':<40} {'meas s':>8} {'pred s':>8} {'err':>7} {'pred DP s':>9} {'at probe':>8} "
          f"{'err':>7}", file=sys.stderr)
    for r in rows:
        print(f"{r['hosts']:>2}x{r['per_host']:<2} {r['layout']:<40} {r['measured_step_s']:>8.3f} "
              f"{r['predicted_step_s']:>8.3f} {r['error']:>+7.1%} {r['predicted_dp_s']:>9.3f} "
              f"{r['predicted_at_probed_link_s']:>8.3f} {r['error_at_probed_link']:>+7.1%}", file=sys.stderr)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
