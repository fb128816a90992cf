"""Training throughput and MFU of hfmeg against transformers, same model, batch and GPU, one run.

Model: LLaMA-2-7B layer shapes (hidden 4096, FFN 11008, 32 heads, vocabulary 32000,
sequence 4096) with `--layers` layers, randomly initialised once by transformers;
`--experts E [--top-k K]` makes it a Mixtral of the same shapes instead (`hf_config`:
every layer's MLP is E SwiGLU experts of FFN `--ffn`, each token routed to K of them);
both sides start from those same weights (hfmeg reads them from memory through
`hfmeg.checkpoint.tensor_source.TensorSource`), see the same token ids, and run full
training steps: `--grad-accum` micro-batches of `--micro-batch-size` sequences
forward and backward, gradient clipping at 1.0, AdamW (lr 3e-4, betas 0.9/0.95,
weight decay 0.1 except norms) and the update.

- hfmeg: a world of one (TP = PP = DP = 1), one `ModelChunk` with document-causal attention,
  RMSNorm/RoPE/SwiGLU compiled by Inductor (`--compile`, default on CUDA), the
  chunked LM-head + cross-entropy, bf16 parameters; `DistributedOptimizer` (mode
  `overlapped`, torch fused AdamW on the fp32 master shard, fp32 main grads); the
  step is `pipeline.forward_backward` + `opt.step()`, as in the trainer.
- anchor: transformers `LlamaForCausalLM` (`MixtralForCausalLM`, its default experts
  implementation) with `attn_implementation="sdpa"`, bf16
  parameters updated by `torch.optim.AdamW(fused=True)` (bf16 moments, no fp32
  master: the fastest and smallest setting HF offers), `clip_grad_norm_(foreach)`.
  `--recompute full` turns on HF activation checkpointing too (same memory regime);
  `--hf-compile` wraps the HF model in `torch.compile`.

`--family MODEL_TYPE` (with `--set FIELD=VALUE` for its own fields) trains transformers' default config of another
family at these shapes instead, the anchor attending eagerly where that family has no SDPA path or soft-caps scores.

`--trainer-path` feeds both sides what the SFT recipe feeds: rows packed by
`hfmeg.data.packing` from synthetic prompt/response documents (lengths log-normal
around seq/14, so ~14 documents per row, prompts masked from the loss), with
`position_ids` and `segment_ids`; hfmeg attends within documents (flex_attention on
CUDA), as the trainer does. transformers gets the rows' `position_ids`, from which it
finds the documents itself (`masking_utils.find_packed_sequence_indices`) and attends
within them through SDPA with a block-diagonal causal mask, as its users train on packed
rows; tokens/s and MFU count every position of every row, padding included, as without
the flag.

Timing: `--warmup` untimed steps (compilation, allocator warm-up), then `--steps`
steps between two `torch.cuda.synchronize()` + `perf_counter()`. Peak memory is
`torch.cuda.max_memory_allocated` since the side's model and optimizer were built
(reset then, and everything of the other side freed before). MFU uses the Megatron-LM
formula (`hfmeg.plan.flops.training_flops`; for an MoE it counts the router and the
top-k experts a token goes through, not all experts) against the dense bf16 peak of the GPU
(989 TFLOP/s for H100/H200 SXM; `--peak-tflops` overrides); null when unknown.

Memory per parameter: hfmeg 18 bytes (bf16 weight, fp32 main grad, fp32 master and
two fp32 moments), the anchor 8 (bf16 weight, grad and two moments), plus
activations; 16 LLaMA-7B layers (3.5 B parameters with embeddings) fit an H200 with
recompute off; 2 Mixtral-8x7B-shaped layers (3.2 B parameters, 8 experts of FFN 14336)
fit an 80 GB H100 (about 58 GiB by the planner). The last line printed is one JSON object.
GPU runs:

    .venv/bin/python tools/bench_mfu.py --layers 16 [--trainer-path]
    .venv/bin/python tools/bench_mfu.py --layers 2 --ffn 14336 --experts 8 --top-k 2
CPU smoke test (fp32, both sides' losses must agree step by step; without a GPU the
tiny shapes are the default, 7B-shape layers would not fit a CPU's memory):

    .venv/bin/python tools/bench_mfu.py --tiny

`--fp8 RECIPE` (tensorwise, rowwise, rowwise_with_gw_hp; docs/fp8.md) adds a third side: hfmeg again, its
linears in FP8 with that torchao recipe (`model.fp8`), from the same weights and batches; the result adds its
tokens/s and MFU (FLOPs counted as for bf16), `fp8_speedup` over hfmeg's own bf16 side, and its losses beside
hfmeg's (`fp8_loss_gap`: the largest step-by-step difference). Off FP8 hardware it runs emulated, which
measures correctness, not speed. The GPU row (tools/gpu_loan.py row4):

    .venv/bin/python tools/bench_mfu.py --layers 16 --trainer-path --fp8 tensorwise
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass
from typing import get_args

import numpy as np
import torch
from transformers import AutoConfig, LlamaConfig, MixtralConfig, PretrainedConfig

from hfmeg.checkpoint.load import load_chunks
from hfmeg.checkpoint.mp_layout import parse_dtype
from hfmeg.checkpoint.tensor_source import TensorSource
from hfmeg.families import model_config_from_hf
from hfmeg.data.formats import Doc
from hfmeg.data.batches import rows_microbatch
from hfmeg.data.microbatch import MicroBatch
from hfmeg.data.packing import IGNORE, Packer
from hfmeg.models.random_init import random_hf_model
from hfmeg.optim import DistributedOptimizer, OptimizerConfig
from hfmeg.parallel.pipeline import forward_backward
from hfmeg.parallel.state import ParallelConfig, ParallelState
from hfmeg.plan.flops import mfu, peak_flops, training_flops
from hfmeg.train.config import FP8Recipe
from bench_args import at_least

SEVEN_B = dict(hidden=4096, ffn=11008, heads=32, vocab=32000, seq=4096, layers=16, micro_batch_size=1,
               grad_accum=4, steps=5, warmup=3)
TINY = dict(hidden=64, ffn=176, heads=4, vocab=300, seq=32, layers=2, micro_batch_size=2, grad_accum=2,
            steps=2, warmup=1)
OPTIM = OptimizerConfig(mode="overlapped", impl="fused", lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                        weight_decay=0.1, grad_clip=1.0)


def shape_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The flags every training-throughput bench shares: shapes, Mixtral experts, compile, dtype, peak, seed."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke test: tiny shapes on the CPU, also on a GPU machine (the default without a GPU)")
    for name in ("layers", "hidden", "ffn", "heads", "vocab", "seq", "micro-batch-size", "grad-accum", "steps",
                 "warmup"):
        p.add_argument(f"--{name}", type=at_least(0 if name == "warmup" else 1), default=None)
    p.add_argument("--experts", type=at_least(1), default=None,
                   help="a Mixtral with this many experts per layer, each of FFN --ffn (default: dense LLaMA)")
    p.add_argument("--top-k", type=at_least(1), default=None, help="experts per token with --experts (default 2)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="Inductor for hfmeg's norm/RoPE/SwiGLU (default: on with CUDA)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense peak per device (default: detected)")
    p.add_argument("--seed", type=int, default=0)
    return p


def resolve_args(p: argparse.ArgumentParser, a: argparse.Namespace, cuda: bool | None = None,
                 defaults: dict | None = None) -> argparse.Namespace:
    """Fill the shape defaults of the device (`defaults` overrides the GPU's) and check the flags together."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not (a.tiny or cuda):
        print(f"{p.prog}: no GPU, running the tiny smoke shapes (LLaMA-7B shapes need a GPU: run it there)",
              file=sys.stderr)
        a.tiny = True
    for k, v in (TINY if a.tiny else {**SEVEN_B, **(defaults or {})}).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.hidden % a.heads:
        p.error(f"--hidden {a.hidden} is not divisible by --heads {a.heads}")
    if a.experts is None:
        if a.top_k is not None:
            p.error("--top-k needs --experts")
    else:
        a.top_k = 2 if a.top_k is None else a.top_k  # Mixtral's
        if a.top_k > a.experts:
            p.error(f"--top-k {a.top_k} is more than --experts {a.experts}")
    return a


def parse_args(argv=None, cuda: bool | None = None) -> argparse.Namespace:
    p = shape_parser("bench_mfu", __doc__.split("\n")[0])
    p.add_argument("--trainer-path", action="store_true",
                   help="packed SFT rows with position_ids/segment_ids, as the recipe feeds the trainer")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    p.add_argument("--hf-compile", action="store_true", help="torch.compile the transformers model too")
    p.add_argument("--fp8", choices=get_args(FP8Recipe)[1:], default=None,
                   help="also run hfmeg with its linears in FP8 with this torchao recipe (model.fp8)")
    p.add_argument("--family", metavar="MODEL_TYPE", default=None,
                   help="another family than LLaMA (qwen3, gemma2, gpt_oss, deepseek_v3, qwen3_5_text, ...): "
                        "transformers' default config of that model_type at these shapes")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="with --family: one more config field, VALUE as JSON where it parses (sliding_window=512, "
                        "num_local_experts=8)")
    a = p.parse_args(argv)
    if a.family and a.experts:
        p.error("--experts makes a Mixtral: give a --family's experts with --set (its own field names)")
    if a.overrides and not a.family:
        p.error("--set needs --family")
    a.overrides = dict(_field(p, kv) for kv in a.overrides)
    return resolve_args(p, a, cuda)


def _field(p: argparse.ArgumentParser, kv: str) -> tuple[str, object]:
    name, sep, value = kv.partition("=")
    if not sep or not name:
        p.error(f"--set {kv!r}: expected FIELD=VALUE")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def bench_device(a) -> torch.device:
    cuda = torch.cuda.is_available() and not a.tiny  # --tiny is the CPU smoke test, on a GPU machine too
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def settings(a, device: torch.device) -> tuple[torch.dtype, dict]:
    """Resolve the device-dependent defaults (dtype, compile) in `a`; return the dtype and the run's shapes."""
    dtype = parse_dtype(a.dtype or ("bf16" if device.type == "cuda" else "fp32"))
    a.compile = device.type == "cuda" if a.compile is None else a.compile
    shapes = dict(layers=a.layers, hidden=a.hidden, ffn=a.ffn, heads=a.heads, vocab=a.vocab, seq=a.seq,
                  experts=a.experts, top_k=a.top_k, micro_batch_size=a.micro_batch_size, grad_accum=a.grad_accum,
                  steps=a.steps, warmup=a.warmup)
    if getattr(a, "family", None):  # bench_mfu's own flags; its lines without them read as LLaMA
        shapes.update(family=a.family, overrides=a.overrides)
    return dtype, shapes


def hf_config(shapes: dict) -> PretrainedConfig:
    """The transformers config of a run's `shapes` (its JSON line's dict), also read by tools/check_plan_gpu.py.

    LLaMA, or Mixtral when `experts` is set (lines written before `--experts` have no such key), or the
    default config of `family` with its `overrides`. All have as many K/V heads as query heads and untied
    embeddings. Router logits are not output, so neither side adds a load-balancing loss: both train on
    the same cross-entropy.
    """
    common = dict(hidden_size=shapes["hidden"], intermediate_size=shapes["ffn"], num_hidden_layers=shapes["layers"],
                  num_attention_heads=shapes["heads"], num_key_value_heads=shapes["heads"],
                  vocab_size=shapes["vocab"], max_position_embeddings=shapes["seq"], rms_norm_eps=1e-5,
                  tie_word_embeddings=False)
    if shapes.get("family"):
        return AutoConfig.for_model(shapes["family"], **{**common, "output_router_logits": False,
                                                         **shapes["overrides"]})
    if shapes.get("experts"):
        return MixtralConfig(**common, num_local_experts=shapes["experts"], num_experts_per_tok=shapes["top_k"],
                             output_router_logits=False)
    return LlamaConfig(**common)


@dataclass
class SideResult:
    losses: list[float]  # every step's global-batch mean loss, warm-up included
    tokens: int  # tokens this side consumed in all steps
    seconds: float  # wall time of the timed steps
    peak_mem_bytes: int | None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _measure(step, a, device) -> SideResult:
    """Run warm-up then timed steps; `step(i)` returns (loss, tokens) of global batch i."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # resident weights/state count, building transients do not
    losses, tokens = [], 0
    for i in range(a.warmup):
        loss, n = step(i)
        losses.append(loss)
        tokens += n
    _sync(device)
    t0 = time.perf_counter()
    for i in range(a.warmup, a.warmup + a.steps):
        loss, n = step(i)
        losses.append(loss)
        tokens += n
    _sync(device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return SideResult(losses, tokens, seconds, peak)


def fused_adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """torch's fused AdamW with OPTIM's hyper-parameters on `model`'s parameters, in whatever dtype they are."""
    named = list(model.named_parameters())
    # Same weight-decay exclusion as hfmeg's OptimizerConfig: norms only.
    groups = [{"params": [p for n, p in named if "norm" not in n]},
              {"params": [p for n, p in named if "norm" in n], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=OPTIM.lr, betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps,
                             weight_decay=OPTIM.weight_decay, fused=True)


def run_hf(model, batches, a, device) -> SideResult:
    """The anchor: transformers' own loss (it shifts labels), fused AdamW on the bf16 parameters."""
    return _measure(build_hf(model, batches, a, device), a, device)


def build_hf(model, batches, a, device):
    """run_hf's training step on `model`: `step(i)` trains on global batch i, returns (loss, tokens)."""
    if a.recompute == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    forward = torch.compile(model) if a.hf_compile else model
    params = list(model.parameters())
    opt = fused_adamw(model)

    def step(i):
        total = torch.zeros((), device=device)
        for mb in batches[i]:
            # transformers shifts labels itself: un-shift the pre-shifted ones (the last is always ignored).
            labels = torch.cat([torch.full_like(mb.labels[:, :1], IGNORE), mb.labels[:, :-1]], dim=1)
            # packed rows: the documents' positions, from which transformers builds its document-causal mask
            loss = forward(input_ids=mb.input_ids, position_ids=mb.position_ids, labels=labels).loss / len(batches[i])
            loss.backward()
            total += loss.detach().float()
        torch.nn.utils.clip_grad_norm_(params, OPTIM.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total.item(), sum(mb.input_ids.numel() for mb in batches[i])

    return step


def run_hfmeg(source, batches, a, device, dtype, fp8: str = "off") -> SideResult:
    """hfmeg as the trainer runs it, in a world of one: forward_backward + the overlapped optimizer."""
    return _measure(build_hfmeg(source, batches, a, device, dtype, fp8), a, device)


def build_hfmeg(source, batches, a, device, dtype, fp8: str = "off"):
    """run_hfmeg's model, optimizer and step (as build_hf's); `fp8`: its linears' FP8 recipe (`model.fp8`)."""
    ps = ParallelState(ParallelConfig(), 0, 1, device)
    chunk = load_chunks(source, ps, dtype=dtype, recompute=a.recompute,
                        compile_backend="inductor" if a.compile else None)[0]
    if fp8 != "off":
        from hfmeg.models.fp8 import convert_fp8  # torchao: only FP8 runs import it

        print("\n".join(convert_fp8([chunk], fp8, [], ps)), file=sys.stderr)
    opt = DistributedOptimizer([chunk], ps, OPTIM)
    # The global batch's loss-token counts, read once here as the data pipeline hands them over.
    num_tokens = [sum(mb.label_tokens() for mb in mbs) for mbs in batches]

    def step(i):
        mbs = batches[i]
        loss = forward_backward([chunk], ps, mbs, schedule="1f1b", num_tokens=num_tokens[i], grad_sync=opt)
        opt.step()
        return loss, sum(mb.input_ids.numel() for mb in mbs)

    return step


def packed_microbatches(a, rng: np.random.Generator) -> MicroBatch:
    """`--micro-batch-size` rows packed as the recipe packs SFT data: prompt (no loss) + response documents."""
    packer = Packer(a.seq, packing=True, pad_id=0)
    mean = max(a.seq / 14, 4.0)
    while len(packer.ready) < a.micro_batch_size:
        n = int(np.clip(rng.lognormal(np.log(mean) - 0.18, 0.6), 4, a.seq))  # mean ~ seq/14
        ids = rng.integers(1, a.vocab, n)
        target = np.arange(n) > n // 3  # the first third is the prompt
        packer.add(Doc(ids, target))
    return rows_microbatch([packer.take() for _ in range(a.micro_batch_size)], a.seq, 0)


def make_batches(a, device) -> list[list[MicroBatch]]:
    """Global batch i: `--grad-accum` micro-batches of input_ids and pre-shifted labels (and packing ids)."""
    g = torch.Generator().manual_seed(a.seed + 1)
    rng = np.random.default_rng(a.seed + 1)
    ignore = torch.full((a.micro_batch_size, 1), IGNORE)
    out = []
    for _ in range(a.warmup + a.steps):
        mbs = []
        for _ in range(a.grad_accum):
            if a.trainer_path:
                mb = packed_microbatches(a, rng)
            else:
                ids = torch.randint(0, a.vocab, (a.micro_batch_size, a.seq), generator=g)
                mb = MicroBatch(input_ids=ids, labels=torch.cat([ids[:, 1:], ignore], dim=1))
            mbs.append(mb.to(device))
        out.append(mbs)
    return out


def peak_flops_of(a, device: torch.device) -> float | None:
    return a.peak_tflops * 1e12 if a.peak_tflops is not None else peak_flops(device)


def main(argv=None) -> dict:
    a = parse_args(argv)
    device = bench_device(a)
    dtype, shapes = settings(a, device)
    hf_cfg = hf_config(shapes)
    cfg = model_config_from_hf(hf_cfg)
    batches = make_batches(a, device)

    model = random_hf_model(hf_cfg, seed=a.seed, dtype=dtype, device=device)
    # transformers runs the experts with torch's grouped_mm where it can, else with its eager loop: record which.
    experts_impl = f"experts={model.config._experts_implementation}, " if cfg.moe else ""
    hf_attention = model.config._attn_implementation
    source = TensorSource.snapshot(model)  # on the CPU: not counted in either side's GPU memory
    hf = run_hf(model, batches, a, device)
    del model
    _free(device)
    ours = run_hfmeg(source, batches, a, device, dtype)
    _free(device)
    fp8 = run_hfmeg(source, batches, a, device, dtype, a.fp8) if a.fp8 else None
    del source
    _free(device)

    peak = peak_flops_of(a, device)
    flops_per_token = training_flops(cfg, 1, a.seq) / a.seq
    timed_tokens = a.steps * a.grad_accum * a.micro_batch_size * a.seq
    tps = {"hfmeg": timed_tokens / ours.seconds, "hf": timed_tokens / hf.seconds,
           **({"hfmeg_fp8": timed_tokens / fp8.seconds} if fp8 else {})}
    rate = {k: (mfu(cfg, v, a.seq, peak, 1) if peak else None) for k, v in tps.items()}
    result_dtype = str(dtype).removeprefix("torch.")
    result = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        dtype=result_dtype,
        hfmeg_tokens_per_s=tps["hfmeg"], hf_tokens_per_s=tps["hf"], speedup=tps["hfmeg"] / tps["hf"],
        hfmeg_mfu=rate["hfmeg"], hf_mfu=rate["hf"],
        hfmeg_peak_mem_bytes=ours.peak_mem_bytes, hf_peak_mem_bytes=hf.peak_mem_bytes,
        hfmeg_tokens=ours.tokens, hf_tokens=hf.tokens, hfmeg_losses=ours.losses, hf_losses=hf.losses,
        peak_flops=peak, flops_per_token=flops_per_token, trainer_path=a.trainer_path, recompute=a.recompute,
        documents_per_row=_documents_per_row(batches) if a.trainer_path else 1.0,
        shapes=shapes,
        **(dict(fp8=a.fp8, hfmeg_fp8_tokens_per_s=tps["hfmeg_fp8"], fp8_speedup=tps["hfmeg_fp8"] / tps["hfmeg"],
                hfmeg_fp8_mfu=rate["hfmeg_fp8"], hfmeg_fp8_peak_mem_bytes=fp8.peak_mem_bytes,
                hfmeg_fp8_losses=fp8.losses,
                fp8_loss_gap=max(abs(x - y) for x, y in zip(fp8.losses, ours.losses))) if fp8 else {}),
        hfmeg_settings=f"compile={'inductor' if a.compile else 'none'} recompute={a.recompute} chunked-CE "
                       "overlapped DistributedOptimizer fused AdamW, fp32 master + main grads",
        hf_settings=f"{hf_attention}, {experts_impl}fused AdamW on {result_dtype} params, clip foreach, "
                    f"activation_checkpointing={a.recompute == 'full'}, torch.compile={a.hf_compile}",
    )
    _print_table(result)
    print(json.dumps(result))
    return result


def _documents_per_row(batches) -> float:
    """Mean documents per packed row (padding is not one)."""
    rows = [seg for mbs in batches for mb in mbs for seg in mb.segment_ids]
    return sum(len(set(seg.tolist()) - {0}) for seg in rows) / len(rows)


def _print_table(r: dict) -> None:
    def gib(b):
        return f"{b / 2**30:.2f}" if b is not None else "-"

    def pct(x):
        return f"{100 * x:.1f}" if x is not None else "-"

    path = f"trainer path, {r['documents_per_row']:.1f} documents/row" if r["trainer_path"] else "unpacked rows"
    print(f"{r['device']}, {r['dtype']}, {path}, shapes {r['shapes']}")
    print(f"{'side':<10}{'tokens/s':>14}{'MFU %':>8}{'peak GiB':>10}{'first loss':>12}")
    for side in ("hfmeg", "hf", *(["hfmeg_fp8"] if "fp8" in r else [])):
        print(f"{side:<10}{r[f'{side}_tokens_per_s']:>14.1f}{pct(r[f'{side}_mfu']):>8}"
              f"{gib(r[f'{side}_peak_mem_bytes']):>10}{r[f'{side}_losses'][0]:>12.5f}")
    print(f"speedup (hfmeg / hf): {r['speedup']:.3f}")
    if "fp8" in r:
        print(f"FP8 {r['fp8']} speedup (over hfmeg bf16): {r['fp8_speedup']:.3f}, largest loss gap {r['fp8_loss_gap']:.2e}")


def run_main(main, tool: str, hint: str) -> None:
    """Run a bench's `main`; running out of GPU memory is one line saying what to try, exit 2."""
    try:
        main()
    except torch.cuda.OutOfMemoryError as e:
        print(f"{tool}: out of GPU memory ({str(e).splitlines()[0]}); {hint}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    run_main(main, "bench_mfu", "try fewer --layers or --recompute full")
