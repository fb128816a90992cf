"""Data pipeline throughput: tokens/s of read + format + tokenize + pack, one process.

    .venv/bin/python tools/bench_data.py [--seq-len 2048] [--repeats 3]

For each source (../shared/assets/data/alpaca_en_demo.json as alpaca SFT,
c4_demo.jsonl as plain text, long documents split) one full pass goes through the real pipeline
(`hfmeg.data.EvalData`: reader -> formatter -> batched fast tokenizer -> packer ->
global batch tensors) with the LLaMA-2 fast tokenizer. Tokens are the real
(non-padding) tokens of the packed rows. The anchor, in the same run, is the bare
Rust tokenizer (`encode_batch` over the records' raw text, already in memory): the
`vs_bare_tokenizer` ratio is the share of the tokenizer's own speed the whole
pipeline keeps. Best of `--repeats` passes. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--assets", type=Path, default=ASSETS)
    args = ap.parse_args()
    logging.getLogger("hfmeg.data").setLevel(logging.ERROR)  # overlong demo records are expected here

    from transformers import AutoTokenizer

    from hfmeg.data import DataConfig, EvalData, SourceConfig

    tok_dir = args.assets / "tokenizers" / "llama2"
    if not (tok_dir / "tokenizer.json").is_file():
        print(f"error: {tok_dir}/tokenizer.json not found", file=sys.stderr)
        sys.exit(2)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    runs = {"alpaca_en_demo.json": "alpaca", "c4_demo.jsonl": "text"}
    result: dict[str, dict[str, float]] = {}
    print(f"{'source':22} {'format':7} {'docs':>6} {'tokens':>9} {'rows':>5} {'fill':>6} "
          f"{'tokens/s':>10} {'bare tok/s':>11} {'ratio':>6}")
    for name, fmt in runs.items():
        path = args.assets / "data" / name
        src = SourceConfig(str(path), format=fmt)
        # long web documents are cut into seq_len pieces (the pre-training setting); SFT is truncated
        cfg = DataConfig(sources=[src], eval_sources=[src], format=fmt, seq_len=args.seq_len,
                         overlong="split" if fmt == "text" else "truncate")
        best = float("inf")
        for _ in range(args.repeats):
            data = EvalData(cfg, tok, dp_rank=0, dp_size=1, micro_batch_size=1, global_batch_size=8)
            t0 = time.perf_counter()
            tokens = rows = 0
            for batch in data:
                for m in batch.microbatches:
                    tokens += int((m["segment_ids"] > 0).sum())
                    rows += int((m["segment_ids"].amax(dim=1) > 0).sum())
            best = min(best, time.perf_counter() - t0)
        texts = [" ".join(str(v) for v in r.record.values()) for r in data.sources[0].records()]
        anchor = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            bare = sum(len(e.ids) for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False))
            anchor = min(anchor, time.perf_counter() - t0)
        r = {"tokens_per_s": tokens / best, "tokens": tokens, "docs": data.report.documents,
             "rows": rows, "fill": tokens / (rows * args.seq_len), "bare_tokenizer_tokens_per_s": bare / anchor,
             "vs_bare_tokenizer": (tokens / best) / (bare / anchor)}
        result[name] = r
        print(f"{name:22} {fmt:7} {r['docs']:6d} {tokens:9d} {rows:5d} {r['fill']:6.1%} "
              f"{r['tokens_per_s']:10.0f} {r['bare_tokenizer_tokens_per_s']:11.0f} {r['vs_bare_tokenizer']:6.2f}")
    print(json.dumps({"bench": "data", "seq_len": args.seq_len, "tokenizer": "llama2",
                      "tokens_per_s": {k: round(v["tokens_per_s"]) for k, v in result.items()},
                      "detail": {k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in result.items()}}))


if __name__ == "__main__":
    main()
