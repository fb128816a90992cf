"""Packed-row attention: plain causal SDPA, the dense-mask path, and hfmeg's document-causal path, one run.

For rows of `--seq` tokens holding 1 and 14 documents (`--docs`), each path runs
forward + backward of one attention call (`--heads` query heads over `--kv-heads`
KV heads, head dim `--head-dim`, GQA shared, not repeated):

- `sdpa_causal` (anchor): `F.scaled_dot_product_attention(is_causal=True)`, no
  document mask: the cost of one long document, flash attention on GPUs;
- `dense_mask`: the `[b, 1, s, s]` boolean document mask into SDPA (hfmeg before
  document-causal attention; no flash kernel, every block computed);
- `document_causal`: `hfmeg.models.document_attention` as the model runs it: plain
  causal for one-document rows, flex_attention with a block mask for packed rows on
  CUDA, the dense mask on CPU (flex has no CPU backward in torch 2.13).

Mask building (once per micro-batch, shared by all layers) is timed apart, as
`mask_ms`. For packed rows the `document_causal` row also times the flex block mask alone:
hfmeg's (`block_mask_ms`: tiles classified from their position and document-id ranges) and,
in the same run, `create_block_mask` scanning every element as hfmeg built it before
(`create_block_mask_ms`: compiled on CUDA, eager elsewhere). Timing: `--warmup` untimed calls, then `--steps` between two
synchronisations. Ratios are against `sdpa_causal` at the same document count, and
`speedup_vs_dense` of `document_causal` over `dense_mask`. One JSON line per row,
then a table. GPU run (bf16, seq 4096, LLaMA-3-8B heads):

    .venv/bin/python tools/bench_attention.py

Without a GPU, the defaults become small fp32 smoke shapes (seq 512, 4/2 heads), and
the note says so: CPU figures say nothing about flash or flex.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from hfmeg.checkpoint.mp_layout import parse_dtype
from torch.nn.attention.flex_attention import create_block_mask

from hfmeg.models.document_attention import (DocumentMask, attend, document_block_mask, document_causal_mask,
                                             flex_applies, plan)
from bench_args import at_least

GPU = dict(seq=4096, batch=1, heads=32, kv_heads=8, head_dim=128, steps=20, warmup=5, dtype="bf16")
CPU = dict(seq=512, batch=1, heads=4, kv_heads=2, head_dim=32, steps=3, warmup=1, dtype="fp32")
PATHS = ("sdpa_causal", "dense_mask", "document_causal")


def parse_args(argv=None, cuda: bool | None = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available() if cuda is None else cuda
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name in ("seq", "batch", "heads", "kv-heads", "head-dim", "steps", "warmup"):
        p.add_argument(f"--{name}", type=at_least(0 if name == "warmup" else 1), default=None)
    p.add_argument("--docs", default="1,14", help="documents per row, comma-separated (default 1,14)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.smoke = not cuda
    for k, v in (GPU if cuda else CPU).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    try:
        a.docs = [int(x) for x in a.docs.split(",")]
    except ValueError:
        p.error(f"--docs must be comma-separated integers, got {a.docs!r}")
    if a.heads % a.kv_heads:
        p.error(f"--heads {a.heads} is not divisible by --kv-heads {a.kv_heads}")
    if any(not 1 <= n <= a.seq for n in a.docs):
        p.error(f"--docs: each count must be in 1..{a.seq} (--seq), got {a.docs}")
    return a


def segment_ids(n_docs: int, seq: int, batch: int, rng: np.random.Generator) -> torch.Tensor:
    """Rows of `n_docs` documents of random lengths filling all `seq` positions (ids 1..n_docs)."""
    rows = []
    for _ in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq), n_docs - 1, replace=False))
        lengths = np.diff(np.concatenate([[0], cuts, [seq]]))
        rows.append(np.repeat(np.arange(1, n_docs + 1), lengths))
    return torch.from_numpy(np.stack(rows))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, a, device) -> float:
    """Milliseconds per call of `fn`, after the warm-up calls."""
    for _ in range(a.warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        fn()
    _sync(device)
    return 1e3 * (time.perf_counter() - t0) / a.steps


def _block_mask_builds(seg: torch.Tensor, a, device: torch.device) -> dict:
    """Milliseconds to build the flex block mask of `seg`: hfmeg's, and create_block_mask's element scan."""
    def same_document_causal(b, h, q, kv):
        return (seg[b, q] == seg[b, kv]) & (q >= kv)

    def scan():
        return create_block_mask(same_document_causal, seg.shape[0], None, a.seq, a.seq, device=device,
                                 _compile=device.type == "cuda")
    ours, theirs = _timed(lambda: document_block_mask(seg), a, device), _timed(scan, a, device)
    return dict(block_mask_ms=ours, create_block_mask_ms=theirs, block_mask_speedup=theirs / ours)


def run(a, device: torch.device, dtype: torch.dtype) -> list[dict]:
    g = torch.Generator(device="cpu").manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    shape = (a.batch, a.heads, a.seq, a.head_dim), (a.batch, a.kv_heads, a.seq, a.head_dim)
    q = torch.randn(shape[0], generator=g).to(device, dtype).requires_grad_()
    k, v = (torch.randn(shape[1], generator=g).to(device, dtype).requires_grad_() for _ in range(2))
    grad = torch.randn(shape[0], generator=g).to(device, dtype)
    scale, gqa = a.head_dim ** -0.5, a.heads != a.kv_heads
    rows = []
    for n in a.docs:
        seg = segment_ids(n, a.seq, a.batch, rng).to(device)
        masks = {"sdpa_causal": lambda: None,
                 "dense_mask": lambda: DocumentMask(dense=document_causal_mask(seg)),
                 "document_causal": lambda: plan(seg, flex=flex_applies(device, a.head_dim))}
        timings = {}
        for path in PATHS:
            docs = masks[path]()

            def step(docs=docs):
                attend(q, k, v, docs, scale, gqa).backward(grad)

            timings[path] = (_timed(step, a, device), _timed(masks[path], a, device))
            del docs
        anchor = timings["sdpa_causal"][0]
        for path, (ms, mask_ms) in timings.items():
            row = dict(path=path, documents=n, ms=ms, mask_ms=mask_ms, ratio_vs_causal=ms / anchor,
                       tokens_per_s=a.batch * a.seq / (ms / 1e3))
            if path == "document_causal":
                row["speedup_vs_dense"] = timings["dense_mask"][0] / ms
                if n > 1:
                    row.update(_block_mask_builds(seg, a, device))
                row["kernel"] = ("sdpa causal" if plan(seg, flex=False) is None
                                 else "flex_attention" if flex_applies(device, a.head_dim) else "sdpa dense mask")
            rows.append(row)
    return rows


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = parse_dtype(a.dtype)
    if a.smoke:
        print("bench_attention: no GPU, small fp32 smoke shapes; flex_attention needs CUDA, so document_causal "
              "is the dense mask here on packed rows", file=sys.stderr)
    rows = run(a, device, dtype)
    common = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  dtype=str(dtype).removeprefix("torch."), smoke=a.smoke,
                  shapes=dict(seq=a.seq, batch=a.batch, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim,
                              steps=a.steps, warmup=a.warmup), torch=torch.__version__)
    rows = [{**common, **r} for r in rows]
    for r in rows:
        print(json.dumps(r))
    print(f"{common['device']}, {common['dtype']}, fwd+bwd per call, {common['shapes']}")
    print(f"{'docs':>5} {'path':<16}{'ms':>10}{'mask ms':>10}{'x causal':>10}{'x dense':>9}")
    for r in rows:
        dense = f"{r['speedup_vs_dense']:.2f}" if "speedup_vs_dense" in r else "-"
        print(f"{r['documents']:>5} {r['path']:<16}{r['ms']:>10.2f}{r['mask_ms']:>10.3f}"
              f"{r['ratio_vs_causal']:>10.2f}{dense:>9}")
    return rows


if __name__ == "__main__":
    main()
