"""`hfmeg convert to-mp|to-hf`: checkpoints between Hugging Face folders and Megatron-style TP x PP shards.

    hfmeg convert to-mp --hf meta-llama/Llama-2-7b-hf --out ckpt/llama7b-tp4pp2 --tp 4 --pp 2
    hfmeg convert to-hf --mp ckpt/llama7b-tp4pp2 --out export/llama7b
    hfmeg convert to-hf --mp out/lora/checkpoints --out export/adapter --merge export/merged

`tools/convert_hf_to_mp.py` and `tools/convert_mp_to_hf.py` are the two directions as scripts (the same flags).
Both stream one tensor at a time (hfmeg/checkpoint/convert.py) and write atomically; bad input is one line
and exit 2.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

from ..config import VOCAB_MULTIPLE
from ..checkpoint.cli import add_layout_args, add_output_args, run_cli
from ..checkpoint.convert import hf_to_mp, mp_to_hf
from ..checkpoint.parity import PREFIX_LAYERS, TOL, check_prefix
from ..checkpoint.hub_source import resolve_hf_source
from ..checkpoint.mp_layout import resolve_iteration_dir
from ..errors import HfmegError
from ..peft.adapter_files import read_peft_folder
from ..hub import write_model_card
from ..peft.export import export_checkpoint, is_adapter_checkpoint, read_info
from ..train.checkpointing import STATE_FILE, read_trainer_state
from ..peft.layout_shards import import_adapter
from ..flags import Parser

TO_MP = """Convert an HF checkpoint (folder or Hub id) into Megatron-style TP x PP shards.

    hfmeg convert to-mp --hf meta-llama/Llama-2-7b-hf --out ckpt/llama7b-tp4pp2 --tp 4 --pp 2

Then it checks what it wrote: the first {layers} layers with the final norm and LM head, read from the shards
on TP forked processes, against transformers' same prefix of the source (fp32 logits within {tol:g}); a mismatch
is one line and exit 2 (the folder is kept). `--no-verify` skips it; `hfmeg verify` checks the whole model.

Streams one tensor at a time; see hfmeg/checkpoint/convert.py. `--adapter FOLDER` also imports a PEFT
LoRA/DoRA adapter (one `peft` wrote, read as `peft.init_from` reads it) onto the shards, as a LoRA run's
checkpoint holds it (hfmeg/peft/layout_shards.py); `to-hf` exports it back.
"""

TO_HF = """Convert Megatron-style TP x PP shards back into an HF folder (safetensors, sharded above --max-shard-size).

    hfmeg convert to-hf --mp ckpt/llama7b-tp4pp2 --out export/llama7b --max-shard-size 5GB

The result loads with AutoModelForCausalLM / AutoTokenizer; config.json keeps every source field.

A LoRA/DoRA training checkpoint (`--peft lora` runs hold adapters, not the frozen base) exports
to a PEFT adapter folder instead, which `peft.PeftModel.from_pretrained(base, OUT)` loads; with
`--merge DIR` also the base with the adapters merged in (the base is the one the run recorded,
refused if its weights changed since):

    hfmeg convert to-hf --mp out/lora/checkpoints --out export/adapter --merge export/merged
"""


def add_to_mp_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--hf", required=True, help="HF folder or Hub repository id")
    add_output_args(ap)
    add_layout_args(ap)
    ap.add_argument("--vocab-multiple", type=int, default=VOCAB_MULTIPLE,
                    help="pad the vocabulary to a multiple of this x TP (Megatron's make_vocab_size_divisible_by)")
    ap.add_argument("--adapter", default=None,
                    help="a PEFT LoRA/DoRA adapter folder (or Hub id) to import onto the shards")
    ap.add_argument("--no-verify", action="store_true",
                    help=f"skip the check of the first {PREFIX_LAYERS} layers' logits against transformers")


def run_to_mp(args: argparse.Namespace) -> int:
    def run():
        extra = None
        if args.adapter:  # read and checked before the base is converted
            cfg, tensors = read_peft_folder(resolve_hf_source(args.adapter, weights=False))
            extra = partial(import_adapter, cfg=cfg, tensors=tensors, base=args.hf)
        out = hf_to_mp(args.hf, args.out, tp=args.tp, pp=args.pp, vpp=args.vpp, pp_layers=args.pp_layers,
                       dtype=args.dtype, vocab_multiple=args.vocab_multiple, overwrite=args.overwrite, extra=extra)
        if not args.no_verify:
            diff = check_prefix(out, resolve_hf_source(args.hf))
            print(f"verified: the first {PREFIX_LAYERS} layers' logits are transformers' within {diff:.1e}")
        return out

    return run_cli(run)


def add_to_hf_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--mp", required=True, help="MP checkpoint folder (or one of its iteration folders)")
    add_output_args(ap)
    ap.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB, 2GiB")
    ap.add_argument("--iteration", type=int, default=None, help="iteration to export (default: the latest)")
    ap.add_argument("--merge", default=None, help="LoRA checkpoints: also write the merged HF model here")


def run_to_hf(args: argparse.Namespace) -> int:
    return run_cli(lambda: _to_hf(args))


def _to_hf(args) -> Path:
    iter_dir = resolve_iteration_dir(args.mp, args.iteration)
    if is_adapter_checkpoint(iter_dir):
        out = export_checkpoint(iter_dir, args.out, merged=args.merge, overwrite=args.overwrite)
        _adapter_cards(iter_dir, out, Path(args.merge) if args.merge else None)
        return out
    if args.merge:
        raise HfmegError(f"--merge: {iter_dir} holds no LoRA adapters (a full model exports to --out alone)")
    return mp_to_hf(args.mp, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size,
                    overwrite=args.overwrite, iteration=args.iteration)


def _adapter_cards(iter_dir: Path, adapter: Path, merged: Path | None) -> None:
    """The cards a run's own export writes (`hub.write_model_card`): the adapter's, and the merged model's; the
    training config and step from the checkpoint's trainer state where it has one (a training checkpoint)."""
    peft, base = read_info(iter_dir)
    state = read_trainer_state(iter_dir) if (iter_dir / STATE_FILE).is_file() else {}
    config = state.get("config", {})
    data = [s["path"] for s in config.get("data", {}).get("sources", [])]
    card = dict(base_model=base["path"], data=data, config=config,
                metrics={"step": state["step"]} if "step" in state else {}, peft=peft)
    write_model_card(adapter, **card, adapter=True)
    if merged is not None:
        write_model_card(merged, **card)


TO_MP = TO_MP.format(layers=PREFIX_LAYERS, tol=TOL)

DIRECTIONS = {  # name -> (description, arguments, run)
    "to-mp": (TO_MP, add_to_mp_args, run_to_mp),
    "to-hf": (TO_HF, add_to_hf_args, run_to_hf),
}


def _direction(name: str, argv: list[str] | None, prog: str | None) -> int:
    description, add_args, run = DIRECTIONS[name]
    ap = Parser(prog=prog, description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    return run(ap.parse_args(argv))


def to_mp(argv: list[str] | None = None, prog: str | None = None) -> int:
    """HF -> MP shards (`hfmeg convert to-mp`, `tools/convert_hf_to_mp.py`)."""
    return _direction("to-mp", argv, prog)


def to_hf(argv: list[str] | None = None, prog: str | None = None) -> int:
    """MP shards -> HF, a LoRA checkpoint -> PEFT adapter (`hfmeg convert to-hf`, `tools/convert_mp_to_hf.py`)."""
    return _direction("to-hf", argv, prog)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="direction", metavar="DIRECTION", title="directions", required=True)
    for name, (description, add_args, run) in DIRECTIONS.items():
        p = sub.add_parser(name, help=description.splitlines()[0], description=description,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_args(p)
        p.set_defaults(run=run)
    args = ap.parse_args(argv)
    return args.run(args)
