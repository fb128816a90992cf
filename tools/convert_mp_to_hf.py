"""Convert Megatron-style TP x PP shards back into an HF folder (safetensors, sharded above --max-shard-size).

    python tools/convert_mp_to_hf.py --mp ckpt/llama7b-tp4pp2 --out export/llama7b --max-shard-size 5GB

The result loads with AutoModelForCausalLM / AutoTokenizer; config.json keeps every source field.

A LoRA/DoRA training checkpoint (`--peft lora` runs hold adapters, not the frozen base) exports
to a PEFT adapter folder instead, which `peft.PeftModel.from_pretrained(base, OUT)` loads; with
`--merge DIR` also the base with the adapters merged in (the base is the one the run recorded,
refused if its weights changed since):

    python tools/convert_mp_to_hf.py --mp out/lora/checkpoints --out export/adapter --merge export/merged
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hfmeg.checkpoint.cli import add_output_args, run_cli
from hfmeg.checkpoint.convert import mp_to_hf
from hfmeg.checkpoint.mp_layout import resolve_iteration_dir
from hfmeg.errors import HfmegError
from hfmeg.peft.export import export_checkpoint, is_adapter_checkpoint


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mp", required=True, help="MP checkpoint folder (or one of its iteration folders)")
    add_output_args(ap)
    ap.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB, 2GiB")
    ap.add_argument("--iteration", type=int, default=None, help="iteration to export (default: the latest)")
    ap.add_argument("--merge", default=None, help="LoRA checkpoints: also write the merged HF model here")
    args = ap.parse_args(argv)
    return run_cli(lambda: _export(args))


def _export(args) -> Path:
    iter_dir = resolve_iteration_dir(args.mp, args.iteration)
    if is_adapter_checkpoint(iter_dir):
        return export_checkpoint(iter_dir, args.out, merged=args.merge, overwrite=args.overwrite)
    if args.merge:
        raise HfmegError(f"--merge: {iter_dir} holds no LoRA adapters (a full model exports to --out alone)")
    return mp_to_hf(args.mp, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size,
                    overwrite=args.overwrite, iteration=args.iteration)


if __name__ == "__main__":
    sys.exit(main())
