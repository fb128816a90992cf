"""LoRA vs full fine-tuning vs QLoRA at the same layout: tokens/s, optimizer + gradient bytes, peak memory.

One gloo world per mode (so each mode's peak RSS is its own processes') trains a
random LLaMA-shaped model at `--tp` x `--pp` (DP fills the rest of `--world`) through
hfmeg's own path: the pipeline schedule and the overlapped distributed optimizer,
fp32 on CPU. `full` trains every weight; `lora` freezes the base and trains rank
`--r` adapters on every projection (`all-linear`), as `--peft lora` does. Reported
per mode: the median step time of the slowest rank, tokens/s, trainable parameters,
this rank's fp32 optimizer state and main-gradient bytes, and the peak RSS (max over
ranks). The anchor, `peft`, trains the same model with `peft` LoRA on transformers (same
r, alpha, all-linear targets, the same tokens: every DP rank's micro-batches, and
AdamW) in one process, so on a GPU `--world 1` compares hfmeg's LoRA with peft's on the
same device in the same run. `qlora` (not run unless `--modes` names it) is `lora` on the
base stored 4-bit (`--peft qlora`: NF4, double quantization), so `--modes lora,qlora
--dtype bf16` measures what QLoRA saves against LoRA on the bf16 base; each mode also
reports the bytes of its frozen base on a rank (parameters and the 4-bit buffers). The
last line printed is one JSON object (with the ratios of tokens/s and peak memory
between the modes run); with no arguments it runs a small CPU shape in a minute or so.

The random model is built and saved (in `--dtype`) by a process of its own, so no
mode's peak includes it: a forked rank starts with its parent's resident pages.

    .venv/bin/python tools/bench_peft.py --world 2 --tp 2 --hidden 512 --layers 4 --r 16
    # QLoRA vs LoRA on the bf16 base, weights dominating (LLaMA-2-7B layer shapes, 16 layers: 3.5B parameters)
    .venv/bin/python tools/bench_peft.py --modes lora,qlora --dtype bf16 --world 1 --tp 1 --hidden 4096 \
        --ffn 11008 --layers 16 --vocab 32000 --seq 64 --microbatches 1 --steps 2
    # one GPU, LLaMA-2-7B layer shapes (bf16; peak = CUDA bytes allocated)
    .venv/bin/python tools/bench_peft.py --device cuda --world 1 --tp 1 --hidden 4096 --ffn 11008 --layers 4 \
        --vocab 32000 --seq 4096 --microbatches 4 --r 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from bench_args import add_layout_model_args, at_least, peak_bytes
from bench_optimizer import make_model

from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.data.microbatch import MicroBatch
from hfmeg.optim import DistributedOptimizer, OptimizerConfig
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.pipeline import forward_backward
from hfmeg.parallel.state import ParallelConfig, ParallelState
from hfmeg.peft.adapters import attach, initialise
from hfmeg.peft.config import PeftConfig
from hfmeg.quant.qlora import Base4bit, Frozen4bitWeight

MODES = ("full", "lora", "qlora", "peft")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _device(a) -> torch.device:
    return torch.device("cuda", dist.get_rank()) if a.device == "cuda" else torch.device("cpu")


def _microbatches(a, dp_rank: int) -> list[MicroBatch]:
    """DP rank `dp_rank`'s micro-batches: the same tokens in every mode."""
    g = torch.Generator().manual_seed(dp_rank)
    return [MicroBatch(input_ids=(ids := torch.randint(0, a.vocab, (1, a.seq), generator=g)), labels=ids)
            for _ in range(a.microbatches)]


def _peft_rank(folder: str, a) -> dict:
    """The anchor: `peft` LoRA on transformers in one process (one GPU), the same r, alpha, targets, tokens
    (every DP rank's micro-batches) and AdamW, the loss summed over tokens / their count as hfmeg's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    device = _device(a)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=_dtype(a), attn_implementation="sdpa").to(device)
    model = get_peft_model(model, LoraConfig(r=a.r, lora_alpha=2 * a.r, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, fused=device.type == "cuda")
    dp = a.world // (a.tp * a.pp)
    mbs = [mb for d in range(dp) for mb in _microbatches(a, d)]
    ntok = a.seq * len(mbs)
    times = []
    for _ in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        for mb in mbs:
            mb = mb.to(device)
            logits = model(input_ids=mb.input_ids).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                     mb.labels.flatten(), reduction="sum") / ntok
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[a.warmup:])
    return dict(step_s=step_s, tokens_per_s=ntok / step_s, peak_bytes=int(peak_bytes(device)),
                trainable_params=sum(p.numel() for p in params), opt_state_bytes=sum(
                    t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if t.dim()),
                main_grad_bytes=sum(p.numel() * p.element_size() for p in params))


def _dtype(a) -> torch.dtype:
    return DTYPES[a.dtype or ("bf16" if a.device == "cuda" else "fp32")]


def _make_model(folder: str, a) -> int:
    """The random model, saved in the run's dtype (a process of its own: module docstring)."""
    return make_model(Path(folder), a, _dtype(a))


def _base_bytes(chunks) -> int:
    """The bytes of this rank's frozen base: untrained parameters and the 4-bit base's buffers."""
    frozen = [p for c in chunks for p in c.parameters() if not p.requires_grad]
    frozen += [b for c in chunks for m in c.modules() if isinstance(m, Frozen4bitWeight) for b in m.buffers()]
    return sum(t.numel() * t.element_size() for t in frozen)


def _rank(mode: str, folder: str, a) -> dict:
    if mode == "peft":
        return _peft_rank(folder, a)
    device = _device(a)
    ps = ParallelState(ParallelConfig(tp=a.tp, pp=a.pp), dist.get_rank(), dist.get_world_size(), device)
    chunks = load_chunks(HFCheckpoint(folder), ps, dtype=_dtype(a), base_4bit=Base4bit() if mode == "qlora" else None)
    if mode in ("lora", "qlora"):
        cfg = PeftConfig(method="lora", r=a.r, alpha=2.0 * a.r, target_modules=["all-linear"])
        for chunk in chunks:
            attach(chunk, cfg)
            initialise(chunk, cfg, seed=0)
    opt = DistributedOptimizer(chunks, ps, OptimizerConfig(lr=1e-3))
    mbs = [mb.to(device) for mb in _microbatches(a, ps.dp_rank)]
    ntok = a.seq * a.microbatches * ps.dp
    times = []
    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        forward_backward(chunks, ps, mbs, schedule="1f1b", num_tokens=ntok, grad_sync=opt)
        opt.step()
        opt.wait_params()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    timed = torch.tensor(times[a.warmup:])
    dist.all_reduce(timed, op=dist.ReduceOp.MAX)
    peak = torch.tensor([peak_bytes(device)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    step_s = statistics.median(timed.tolist())
    return dict(step_s=step_s, tokens_per_s=ntok / step_s, peak_bytes=int(peak.item()), base_bytes=_base_bytes(chunks),
                trainable_params=sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad),
                opt_state_bytes=opt.state_bytes(),
                main_grad_bytes=sum(gr.grad_buffer.numel() * gr.grad_buffer.element_size() for gr in opt.groups))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_layout_model_args(ap, world=2, tp=2, hidden=256, layers=4)
    ap.add_argument("--vocab", type=at_least(2), default=2048)
    ap.add_argument("--seq", type=at_least(2), default=128)
    ap.add_argument("--microbatches", type=at_least(1), default=2, help="per DP rank and step")
    ap.add_argument("--r", type=at_least(1), default=16, help="LoRA rank")
    ap.add_argument("--steps", type=at_least(1), default=5)
    ap.add_argument("--warmup", type=at_least(0), default=1)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: one GPU per rank (peak = CUDA bytes allocated); cpu: peak = RSS")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                    help="the saved model's and the runs' dtype (default: bf16 on cuda, fp32 on cpu)")
    ap.add_argument("--modes", type=_modes, default=("full", "lora", "peft"),
                    help=f"comma-separated, of {', '.join(MODES)} (default: full,lora,peft)")
    a = ap.parse_args(argv)
    if a.device == "cuda" and a.world != 1:
        ap.error("--device cuda runs --world 1 (all three modes on the same GPU, one after the other)")
    if a.world % (a.tp * a.pp) or a.hidden % 64 or (a.hidden // 64) % a.tp:
        ap.error("--tp x --pp must divide --world, and --tp the head count (--hidden / 64)")
    if a.layers < a.pp:
        ap.error("--layers must be >= --pp")
    with tempfile.TemporaryDirectory() as tmp:
        params = spawn(_make_model, 1, tmp, a, timeout_s=1800)[0]
        # peft + transformers runs in one process: the whole batch, on one GPU (or CPU process)
        rows = {mode: spawn(_rank, 1 if mode == "peft" else a.world, mode, tmp, a, timeout_s=1800)[0]
                for mode in MODES if mode in a.modes}
    peak = "peak CUDA MiB" if a.device == "cuda" else "peak RSS MiB"
    print(f"{'mode':6} {'step s':>8} {'tok/s':>9} {'trainable':>11} {'opt+grad MiB':>13} {'base MiB':>9} {peak:>13}")
    for mode, r in rows.items():
        state = (r["opt_state_bytes"] + r["main_grad_bytes"]) / 2**20
        base = f"{r['base_bytes'] / 2**20:9.1f}" if "base_bytes" in r else f"{'-':>9}"
        print(f"{mode:6} {r['step_s']:8.3f} {r['tokens_per_s']:9.0f} {r['trainable_params']:11,} {state:13.2f} "
              f"{base} {r['peak_bytes'] / 2**20:13.1f}")
    ratios = {}
    for mode, other in (("lora", "full"), ("lora", "peft"), ("qlora", "lora")):
        if mode in rows and other in rows:
            ratios[f"{mode}_vs_{other}_tokens_per_s"] = rows[mode]["tokens_per_s"] / rows[other]["tokens_per_s"]
            ratios[f"{mode}_vs_{other}_peak"] = rows[mode]["peak_bytes"] / rows[other]["peak_bytes"]
    print(json.dumps(dict(device=a.device, dtype=str(_dtype(a)).removeprefix("torch."), world=a.world, tp=a.tp,
                          pp=a.pp, hidden=a.hidden, layers=a.layers, seq=a.seq, r=a.r, params=params, by_mode=rows,
                          **ratios)))
    return 0


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m for m in text.split(",") if m)
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"{text!r}: modes are a comma-separated list of {', '.join(MODES)}")
    return modes


if __name__ == "__main__":
    sys.exit(main())
