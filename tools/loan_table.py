"""README's speed table from a loan's rows (tools/gpu_loan.py's rows.jsonl, committed under docs/measurements/).

One line per measured `row` record: the row, the system, packed or not, median tokens/s over its rounds, MFU and the
ratio to hfmeg on the same rows; skipped systems and errors are listed under the table with their reasons.

    python tools/loan_table.py docs/measurements/h100_loan_2026-12-01.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TITLES = {"row1": "7B layers × 16, trainer path", "row2": "7B layers × 16, peers",
          "row3": "Mixtral shapes, 2 layers, 8 experts top-2", "row4": "FP8 vs bf16"}


def table(rows: list[dict]) -> str:
    env = next((r for r in rows if r.get("kind") == "env"), {})
    out = [f"{env.get('device', 'device unknown')}, torch {env.get('versions', {}).get('torch', '?')}, "
           f"loan {rows[0].get('loan', '?') if rows else '?'}; bf16 GEMM ceiling "
           + (f"{env['gemm_tflops']:.0f} TFLOP/s" if env.get("gemm_tflops") else "not measured"), "",
           "| row | system | rows | tokens/s (median) | MFU | vs hfmeg |", "|---|---|---|---|---|---|"]
    notes = []
    for r in rows:
        if r.get("kind") == "row" and "tokens_per_s" in r:
            mfu = f"{100 * r['mfu']:.1f} %" if r.get("mfu") is not None else "-"
            ratio = f"{r['ratio_vs_hfmeg']:.2f}" if r.get("ratio_vs_hfmeg") is not None else "-"
            out.append(f"| {TITLES.get(r['step'], r['step'])} | {r['system']} | "
                       f"{'packed' if r.get('packed') else 'unpacked'} | {r['tokens_per_s']:,.0f} | {mfu} | {ratio} |")
        elif r.get("kind") in ("row", "smoke") and r.get("skipped"):
            if r.get("kind") == "row":
                notes.append(f"- {TITLES.get(r['step'], r['step'])}, {r['system']}: {r['skipped']}")
        elif r.get("kind") == "error":
            notes.append(f"- {r.get('step')}, {r.get('system', 'the step')}: error {r['error']}")
        elif r.get("kind") == "step" and r.get("status") not in ("ok", None):
            notes.append(f"- step {r['step']}: {r['status']}" + (f" ({r['reason']})" if r.get("reason") else ""))
    return "\n".join(out + ([""] + notes if notes else []))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="loan_table", description=__doc__.split("\n")[0])
    p.add_argument("rows", type=Path)
    a = p.parse_args(argv)
    try:
        rows = [json.loads(line) for line in a.rows.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        print(f"loan_table: {a.rows}: {e}", file=sys.stderr)
        return 2
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
