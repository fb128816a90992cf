"""Convert Megatron-style TP x PP shards back into an HF folder (safetensors, sharded above --max-shard-size).

    python tools/convert_mp_to_hf.py --mp ckpt/llama7b-tp4pp2 --out export/llama7b --max-shard-size 5GB

The result loads with AutoModelForCausalLM / AutoTokenizer; config.json keeps every source field.
"""

from __future__ import annotations

import argparse
import sys

from hfmeg.checkpoint.cli import add_output_args, run_cli
from hfmeg.checkpoint.convert import mp_to_hf


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mp", required=True, help="MP checkpoint folder (or one of its iteration folders)")
    add_output_args(ap)
    ap.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB, 2GiB")
    ap.add_argument("--iteration", type=int, default=None, help="iteration to export (default: the latest)")
    args = ap.parse_args(argv)
    return run_cli(lambda: mp_to_hf(args.mp, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size,
                                    overwrite=args.overwrite, iteration=args.iteration))


if __name__ == "__main__":
    sys.exit(main())
