"""Reshard an MP checkpoint to another TP x PP (x VPP) layout, directly and streaming.

    python tools/reshard_mp.py --mp ckpt/llama7b-tp2pp2 --out ckpt/llama7b-tp4pp1 --tp 4 --pp 1

Model weights only: on a training checkpoint it says what is not carried (optimizer,
step, data position) and how to train from the result.
"""

from __future__ import annotations

import argparse
import sys

from hfmeg.checkpoint.cli import add_layout_args, add_output_args, run_cli
from hfmeg.checkpoint.reshard import reshard_mp, training_state_note


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mp", required=True, help="source MP checkpoint folder")
    add_output_args(ap)
    add_layout_args(ap)
    ap.add_argument("--iteration", type=int, default=None, help="iteration to read (default: the latest)")
    args = ap.parse_args(argv)

    def run():
        out = reshard_mp(args.mp, args.out, tp=args.tp, pp=args.pp, vpp=args.vpp, pp_layers=args.pp_layers,
                         dtype=args.dtype, overwrite=args.overwrite, iteration=args.iteration)
        note = training_state_note(args.mp, args.iteration)
        if note:
            print(note)
        return out

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
