"""Convert an HF checkpoint (folder or Hub id) into Megatron-style TP x PP shards.

    python tools/convert_hf_to_mp.py --hf meta-llama/Llama-2-7b-hf --out ckpt/llama7b-tp4pp2 --tp 4 --pp 2

Streams one tensor at a time; see hfmeg/checkpoint/convert.py.
"""

from __future__ import annotations

import argparse
import sys

from hfmeg.checkpoint.cli import add_layout_args, add_output_args, run_cli
from hfmeg.checkpoint.convert import hf_to_mp


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", required=True, help="HF folder or Hub repository id")
    add_output_args(ap)
    add_layout_args(ap)
    ap.add_argument("--vocab-multiple", type=int, default=128,
                    help="pad the vocabulary to a multiple of this x TP (Megatron's make_vocab_size_divisible_by)")
    args = ap.parse_args(argv)
    return run_cli(lambda: hf_to_mp(args.hf, args.out, tp=args.tp, pp=args.pp, vpp=args.vpp, pp_layers=args.pp_layers,
                                    dtype=args.dtype, vocab_multiple=args.vocab_multiple, overwrite=args.overwrite))


if __name__ == "__main__":
    sys.exit(main())
