"""Benchmark hfmeg's MoE layer over expert-parallel sizes: throughput, all-to-all bytes, FLOPs.

On one gloo world of `--world` ranks (each one DP rank with its own `--tokens` tokens),
the MoE block of a Mixtral-shaped layer (`--hidden`, `--ffn` per expert, `--experts`,
`--top-k`) runs forward + backward at every EP size in `--ep` (each dividing the
world and the expert count). Per EP size:

- tokens/s: the world's tokens over the slowest rank's median step, and its ratio to
  EP = 1 (the anchor: every rank holds every expert, no token leaves its rank);
- all-to-all bytes per rank and forward pass, counted from the dispatcher's own split
  sizes (rows sent to other ranks at dispatch, plus rows sent back at combine), against
  the minimum for balanced routing, 2 × tokens × top-k × hidden × bytes × (EP−1)/EP;
  the backward pass moves the same bytes again;
- the layer's FLOPs per token as a dense model counts them (router + top-k experts,
  forward and backward) and the TFLOP/s they make.

The router is random, so routing is about balanced; the ratio to the minimum shows how
far the real split is from perfect balance. The last line printed is one JSON object.

    .venv/bin/python tools/bench_moe.py --world 4 --ep 1 2 4
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist
from transformers import MixtralConfig

from bench_args import at_least
from bench_optimizer import timed
from hfmeg.families import model_config_from_hf
from hfmeg.models.kernels import Kernels
from hfmeg.models.moe import MoELayer
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.state import ParallelConfig, ParallelState


class _CountingDispatcher:
    """The layer's dispatcher, counting the rows each all-to-all sends to other ranks."""

    def __init__(self, inner, ep_rank: int):
        self.inner, self.ep_rank, self.rows_off_rank = inner, ep_rank, 0

    def dispatch(self, x, experts):
        d = self.inner.dispatch(x, experts)
        if d.send:  # EP > 1: what leaves at dispatch, and what leaves again at combine
            self.rows_off_rank += sum(d.send) - d.send[self.ep_rank] + sum(d.recv) - d.recv[self.ep_rank]
        return d

    def combine(self, y, d):
        return self.inner.combine(y, d)


def _layer(a, ep: int) -> tuple[MoELayer, _CountingDispatcher]:
    cfg = model_config_from_hf(MixtralConfig(hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=1,
                                             num_attention_heads=max(1, a.hidden // 64),
                                             num_key_value_heads=max(1, a.hidden // 64), vocab_size=128,
                                             num_local_experts=a.experts, num_experts_per_tok=a.top_k))
    ps = ParallelState(ParallelConfig(ep=ep), dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    torch.manual_seed(0)
    layer = MoELayer(cfg, ps, Kernels(None))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02)
    counter = _CountingDispatcher(layer.dispatcher, ps.ep_rank)
    layer.dispatcher = counter
    return layer, counter


def _worker(a) -> dict:
    out = {}
    for ep in a.ep:
        layer, counter = _layer(a, ep)
        torch.manual_seed(1 + dist.get_rank())  # every rank its own tokens
        x = torch.randn(a.tokens, 1, a.hidden, requires_grad=True)

        def step():
            layer(x).float().pow(2).mean().backward()

        step()  # warm-up
        counter.rows_off_rank = 0
        seconds = timed(step, a.reps)
        out[ep] = dict(step_s=seconds, all_to_all_bytes=counter.rows_off_rank * a.hidden * 4 // a.reps)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=at_least(1), default=4, help="gloo ranks (DP size)")
    ap.add_argument("--ep", type=at_least(1), nargs="+", default=[1, 2, 4])
    ap.add_argument("--tokens", type=at_least(1), default=512, help="tokens per rank")
    ap.add_argument("--hidden", type=at_least(8), default=256)
    ap.add_argument("--ffn", type=at_least(1), default=512, help="FFN size of each expert")
    ap.add_argument("--experts", type=at_least(1), default=8)
    ap.add_argument("--top-k", type=at_least(1), default=2)
    ap.add_argument("--reps", type=at_least(1), default=5)
    a = ap.parse_args(argv)
    bad = [ep for ep in a.ep if a.world % ep or a.experts % ep]
    if bad or a.top_k > a.experts:
        ap.error(f"--ep {bad} must divide --world {a.world} and --experts {a.experts}" if bad
                 else f"--top-k {a.top_k} is more than --experts {a.experts}")

    per_rank = spawn(_worker, a.world, a)
    h, f, e, k = a.hidden, a.ffn, a.experts, a.top_k
    flops_per_token = 3 * 2 * (h * e + k * 3 * h * f)  # forward + backward: router and the top-k SwiGLU experts
    world_tokens = a.world * a.tokens
    rows, anchor = {}, None
    print(f"{'EP':>3} {'step s':>8} {'tok/s':>9} {'vs EP1':>7} {'a2a bytes/rank':>15} {'minimum':>12} {'ratio':>6} "
          f"{'TFLOP/s':>8}")
    for ep in a.ep:
        step_s = per_rank[0][ep]["step_s"]  # timed(): already the slowest rank's median
        sent = max(r[ep]["all_to_all_bytes"] for r in per_rank)
        minimum = 2 * a.tokens * k * h * 4 * (ep - 1) / ep
        tps = world_tokens / step_s
        anchor = anchor or (tps if ep == 1 else None)
        rows[ep] = dict(step_s=step_s, tokens_per_s=tps, vs_ep1=tps / anchor if anchor else None,
                        all_to_all_bytes_per_rank=sent, all_to_all_min_bytes=minimum,
                        bytes_vs_min=sent / minimum if minimum else None,
                        tflops=flops_per_token * world_tokens / step_s / 1e12)
        r = rows[ep]
        print(f"{ep:>3} {step_s:>8.4f} {tps:>9.0f} {r['vs_ep1'] or float('nan'):>7.2f} {sent:>15,} "
              f"{minimum:>12,.0f} {r['bytes_vs_min'] or float('nan'):>6.2f} {r['tflops']:>8.4f}")
    result = dict(world=a.world, tokens_per_rank=a.tokens, hidden=h, expert_ffn=f, experts=e, top_k=k,
                  flops_per_token=flops_per_token, by_ep={str(ep): rows[ep] for ep in a.ep})
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
