"""Reshard an MP checkpoint to another TP x PP (x VPP) layout, directly and streaming.

    hfmeg reshard --mp ckpt/llama7b-tp2pp2 --out ckpt/llama7b-tp4pp1 --tp 4 --pp 1

A training checkpoint (one with trainer_state.json) is resharded whole: model,
optimizer state, step and data position, so `--resume` continues the run at the new
layout (its model part: hfmeg/train/parts/, hfmeg/train/reshard_checkpoint.py); a LoRA/DoRA one moves its adapter shards and their
optimizer state (the base it references is not in it). `tools/reshard_mp.py` is the same command.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..checkpoint.cli import add_layout_args, add_output_args, run_cli
from ..checkpoint.mp_layout import resolve_iteration_dir
from ..checkpoint.reshard import reshard_mp
from ..train.checkpointing import STATE_FILE
from ..train.parts import reshard_training_checkpoint
from ..flags import Parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mp", required=True, help="source MP checkpoint folder")
    add_output_args(ap)
    add_layout_args(ap)
    ap.add_argument("--iteration", type=int, default=None, help="iteration to read (default: the latest)")
    args = ap.parse_args(argv)

    def run():
        folder = resolve_iteration_dir(args.mp, args.iteration)
        if not (folder / STATE_FILE).is_file():
            return reshard_mp(args.mp, args.out, tp=args.tp, pp=args.pp, vpp=args.vpp, pp_layers=args.pp_layers,
                              dtype=args.dtype, overwrite=args.overwrite, iteration=args.iteration)
        out = reshard_training_checkpoint(args.mp, args.out, tp=args.tp, pp=args.pp, vpp=args.vpp,
                                          pp_layers=args.pp_layers, dtype=args.dtype, overwrite=args.overwrite,
                                          iteration=args.iteration)
        step = json.loads((folder / STATE_FILE).read_text()).get("step")
        after.append(f"training checkpoint (step {step}): model, optimizer state, step and data position "
                     f"resharded; continue with --tp {args.tp} --pp {args.pp} --vpp {args.vpp} "
                     f"--resume {Path(args.out) / folder.name}")
        return out

    after: list[str] = []  # said after run_cli's "wrote ..." line
    rc = run_cli(run)
    for line in after:
        print(line)
    return rc
