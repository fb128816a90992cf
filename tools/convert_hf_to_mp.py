"""Convert an HF checkpoint (folder or Hub id) into Megatron-style TP x PP shards.

    python tools/convert_hf_to_mp.py --hf meta-llama/Llama-2-7b-hf --out ckpt/llama7b-tp4pp2 --tp 4 --pp 2

Streams one tensor at a time; see hfmeg/checkpoint/convert.py. `--adapter FOLDER` also imports a PEFT
LoRA/DoRA adapter (one `peft` wrote, read as `peft.init_from` reads it) onto the shards, as a LoRA run's
checkpoint holds it (hfmeg/peft/layout_shards.py); `convert_mp_to_hf.py` exports it back.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

from hfmeg.checkpoint.cli import add_layout_args, add_output_args, run_cli
from hfmeg.checkpoint.convert import hf_to_mp
from hfmeg.checkpoint.hub_source import resolve_hf_source
from hfmeg.peft.adapter_files import read_peft_folder
from hfmeg.peft.layout_shards import import_adapter


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", required=True, help="HF folder or Hub repository id")
    add_output_args(ap)
    add_layout_args(ap)
    ap.add_argument("--vocab-multiple", type=int, default=128,
                    help="pad the vocabulary to a multiple of this x TP (Megatron's make_vocab_size_divisible_by)")
    ap.add_argument("--adapter", default=None,
                    help="a PEFT LoRA/DoRA adapter folder (or Hub id) to import onto the shards")
    args = ap.parse_args(argv)

    def run():
        extra = None
        if args.adapter:  # read and checked before the base is converted
            cfg, tensors = read_peft_folder(resolve_hf_source(args.adapter, weights=False))
            extra = partial(import_adapter, cfg=cfg, tensors=tensors, base=args.hf)
        return hf_to_mp(args.hf, args.out, tp=args.tp, pp=args.pp, vpp=args.vpp, pp_layers=args.pp_layers,
                        dtype=args.dtype, vocab_multiple=args.vocab_multiple, overwrite=args.overwrite, extra=extra)

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
