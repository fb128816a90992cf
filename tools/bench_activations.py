"""Activation memory per decoder layer for recompute none / selective / full, measured.

Each TP rank builds decoder-only chunks (no embedding, no head) of 1 and of 2
layers at LLaMA-2-13B layer shapes (hidden 5120, 40 heads, FFN 13824) and runs one
forward under `hfmeg.parallel.activation_meter.SavedTensorMeter`; the bytes saved
for backward when the forward ends are the micro-batch's activations. The 2-layer
minus the 1-layer figure is one layer's (what the model's depth multiplies); the
rest is shared by all layers (RoPE tables, document mask). Also reported: one
layer's bytes as a multiple of s·b·h (Korthikanti et al. 2022 count 34 s·b·h per
layer for selective recompute in 16-bit, 34 + 5·a·s/h without it, 2 with full),
per TP rank, so they scale to any sequence length (the core is flash/flex-style:
no s² term is kept).

The CPU default is `--seq 512` (13B layers at seq 4096 take minutes per forward on
two cores); activations are linear in s, so the multiple carries over. One JSON line
per mode, then a table. `--compile` runs norm/RoPE/SwiGLU through Inductor as the
GPU recipes do (`compile: true`); its partitioner keeps fewer intermediates than
the eager kernels (e.g. no fp32 copy of each norm's input):

    .venv/bin/python tools/bench_activations.py [--tp 2 --sp] [--compile]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from transformers import LlamaConfig

from hfmeg.checkpoint.mp_layout import parse_dtype
from hfmeg.families import model_config_from_hf
from hfmeg.models.decoder import RECOMPUTE_MODES, ModelChunk
from hfmeg.parallel.activation_meter import SavedTensorMeter
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.state import ParallelConfig, ParallelState
from bench_args import at_least


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=at_least(1), default=5120)
    p.add_argument("--ffn", type=at_least(1), default=13824)
    p.add_argument("--heads", type=at_least(1), default=40)
    p.add_argument("--seq", type=at_least(1), default=512)
    p.add_argument("--micro-batch", type=at_least(1), default=1)
    p.add_argument("--tp", type=at_least(1), default=1)
    p.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--compile", action="store_true",
                   help="norm/RoPE/SwiGLU compiled by Inductor, as the GPU recipes run them (default: eager)")
    a = p.parse_args(argv)
    if a.hidden % a.heads or a.heads % a.tp or a.ffn % a.tp:
        p.error(f"--heads {a.heads} must divide --hidden {a.hidden}, and --tp {a.tp} --heads and --ffn")
    if a.sp and (a.tp < 2 or a.seq % a.tp):
        p.error(f"--sp needs --tp > 1 dividing --seq {a.seq}")
    return a


def _saved_bytes(a, ps: ParallelState, layers: int, recompute: str) -> int:
    hf = LlamaConfig(hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=layers,
                     num_attention_heads=a.heads, num_key_value_heads=a.heads, vocab_size=128,
                     max_position_embeddings=a.seq)
    torch.manual_seed(0)
    chunk = ModelChunk(model_config_from_hf(hf), ps, range(layers), pre_process=False, post_process=False,
                       recompute=recompute, compile_backend="inductor" if a.compile else None)
    with torch.no_grad():
        for p in chunk.parameters():
            p.normal_(0.0, 0.02)
    chunk = chunk.to(parse_dtype(a.dtype))
    s_local = a.seq // a.tp if a.sp else a.seq
    x = torch.randn(s_local, a.micro_batch, a.hidden, dtype=chunk.layers["0"].input_norm.weight.dtype,
                    requires_grad=True)
    meter = SavedTensorMeter([chunk])
    with meter.hooks():
        y = chunk(x, seq_len=a.seq)
    saved = meter.live
    del y  # no backward needed: dropping the output frees the graph and what it saved
    return saved


def _rank(a) -> dict:
    import torch.distributed as dist

    ps = ParallelState(ParallelConfig(tp=a.tp, sequence_parallel=a.sp), dist.get_rank(), dist.get_world_size(),
                       torch.device("cpu"))
    out = {}
    for mode in RECOMPUTE_MODES:
        one, two = _saved_bytes(a, ps, 1, mode), _saved_bytes(a, ps, 2, mode)
        out[mode] = (two - one, 2 * one - two)
    return out


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    measured = spawn(_rank, a.tp, a, timeout_s=3600)[0]
    sbh = a.seq * a.micro_batch * a.hidden
    rows = []
    for mode, (per_layer, shared) in measured.items():
        rows.append(dict(recompute=mode, bytes_per_layer=per_layer, shared_bytes=shared,
                         sbh_multiple=per_layer / sbh,
                         dtype=a.dtype, tp=a.tp, sp=a.sp, compile=a.compile,
                         shapes=dict(hidden=a.hidden, ffn=a.ffn, heads=a.heads, seq=a.seq,
                                     micro_batch=a.micro_batch)))
    for r in rows:
        print(json.dumps(r))
    kernels = "inductor" if a.compile else "eager"
    print(f"activations per layer per TP rank, {a.dtype}, {kernels} kernels, tp={a.tp} sp={a.sp}, {rows[0]['shapes']}")
    print(f"{'recompute':<11}{'MiB/layer':>11}{'x s*b*h':>9}{'shared MiB':>12}")
    for r in rows:
        print(f"{r['recompute']:<11}{r['bytes_per_layer'] / 2**20:>11.1f}{r['sbh_multiple']:>9.2f}"
              f"{r['shared_bytes'] / 2**20:>12.2f}")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
