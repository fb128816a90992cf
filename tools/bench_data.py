"""Data pipeline throughput: tokens/s of read + format + tokenize + pack, one process.

    .venv/bin/python tools/bench_data.py [--seq-len 2048] [--repeats 3]

For each source (../shared/assets/data/alpaca_en_demo.json as alpaca SFT,
c4_demo.jsonl as plain text, long documents split) one full pass goes through the real pipeline
(`hfmeg.data.EvalData`: reader -> formatter -> batched fast tokenizer -> packer ->
global batch tensors) with the LLaMA-2 fast tokenizer. Tokens are the real
(non-padding) tokens of the packed rows. The anchor, in the same run, is the bare
Rust tokenizer (`encode_batch` over the records' raw text, already in memory): the
`vs_bare_tokenizer` ratio is the share of the tokenizer's own speed the whole
pipeline keeps. Best of `--repeats` passes.

Then the training stream (`TrainData`, alpaca, `--global-batch` rows a step):
- `build_ms`: one step built in the consumer's thread (`data.prefetch: 0`) on DP rank 0
  of DP=1 and of DP=8 (every rank tokenises and packs the whole global batch; DP=8
  turns only its 1/8 of the rows into arrays and tensors);
- `wait_ms`: with `data.prefetch: 2`, DP=8, the time a consumer whose step takes
  1.5x the slowest build measured (a sleep, as a GPU step leaves the host waiting) is
  blocked in `next()`: about 0 when building ahead hides the data work;
- a 3.4 MB record (`truncate`): three steps with it among their records vs without it,
  and tokenising its text in full (what every read of it cost before).
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--assets", type=Path, default=ASSETS)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
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
                    tokens += int((m.segment_ids > 0).sum())
                    rows += int((m.segment_ids.amax(dim=1) > 0).sum())
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
    stream = train_stream(args, tok)
    print(json.dumps({"bench": "data", "seq_len": args.seq_len, "tokenizer": "llama2",
                      "tokens_per_s": {k: round(v["tokens_per_s"]) for k, v in result.items()},
                      "detail": {k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in result.items()},
                      "train_stream": stream}))


def train_stream(args, tok) -> dict[str, float]:
    """Per-step build and wait times of the training stream, and the cost of one huge record."""
    from hfmeg.data import DataConfig, SourceConfig, TrainData

    src = SourceConfig(str(args.assets / "data" / "alpaca_en_demo.json"))
    cfg = DataConfig(sources=[src], seq_len=args.seq_len, prefetch=0)

    def loader(dp: int, **kw) -> TrainData:
        d = TrainData(replace(cfg, **kw), tok, dp_rank=0, dp_size=dp, micro_batch_size=1,
                      global_batch_size=args.global_batch)
        next(d)  # the first step also opens the source
        return d

    def per_step(data: TrainData, compute_s: float = 0.0) -> float:
        waited = 0.0
        for _ in range(args.steps):
            time.sleep(compute_s)  # the step on the batch before
            t0 = time.perf_counter()
            next(data)
            waited += time.perf_counter() - t0
        return waited / args.steps

    builds = {dp: [per_step(loader(dp)) for _ in range(args.repeats)] for dp in (1, 8)}
    out = {f"build_ms_dp{dp}": 1e3 * min(b) for dp, b in builds.items()}
    ahead = loader(8, prefetch=2)
    out["wait_ms_dp8_prefetch2"] = 1e3 * per_step(ahead, 1.5 * max(max(b) for b in builds.values()))
    ahead.close()
    with tempfile.TemporaryDirectory() as tmp:
        records = json.loads(Path(src.path).read_text())
        prose = (args.assets / "data" / "wiki_demo.txt").read_text()
        huge = {"instruction": "Summarise.", "input": "", "output": (prose * 4)[:3_400_000]}
        for name, recs in (("plain", records), ("huge", records[:300] + [huge] + records[300:])):
            path = Path(tmp) / f"{name}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in recs))
            data = TrainData(replace(cfg, sources=[SourceConfig(str(path))]), tok, dp_rank=0, dp_size=1,
                             micro_batch_size=1, global_batch_size=args.global_batch)
            next(data)
            t0 = time.perf_counter()
            for _ in range(3):  # the huge record (number 301) is read in one of these steps
                next(data)
            out[f"{name}_3_steps_ms"] = 1e3 * (time.perf_counter() - t0)
        t0 = time.perf_counter()
        tok.backend_tokenizer.encode(huge["output"], add_special_tokens=False)
        out["huge_record_full_tokenise_ms"] = 1e3 * (time.perf_counter() - t0)
    print(f"train stream, {args.global_batch} rows/step: build {out['build_ms_dp1']:.0f} ms/step at DP=1, "
          f"{out['build_ms_dp8']:.0f} ms at DP=8; with prefetch a consumer waits "
          f"{out['wait_ms_dp8_prefetch2']:.1f} ms/step; 3 steps {out['plain_3_steps_ms']:.0f} ms, "
          f"{out['huge_3_steps_ms']:.0f} ms with a 3.4 MB record among them "
          f"(tokenising it in full: {out['huge_record_full_tokenise_ms']:.0f} ms)")
    return {k: round(v, 2) for k, v in out.items()}


if __name__ == "__main__":
    main()
