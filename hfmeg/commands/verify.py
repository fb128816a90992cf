"""Check a converted MP checkpoint against transformers: logits and greedy generation.

    hfmeg verify --mp ckpt/llama7b-tp4pp2 --hf meta-llama/Llama-2-7b-hf
    torchrun --nproc-per-node 8 -m hfmeg verify --mp ckpt/llama7b-tp4pp2 --hf ...

Runs the sharded model on TP x PP processes: gloo workers it forks itself, or the
torchrun/accelerate world it is started in (RANK and WORLD_SIZE set). Both sides run
in fp32 on the same token ids (the checkpoint's tokenizer, else fixed ids). Prints
`max_abs_logit_diff=<x>` and both greedy continuations; exits 1 when the difference
is above --tol or the continuations differ, 2 on bad input. `tools/verify_parity.py` is the same command.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch.distributed as dist

from ..checkpoint.cli import run_cli
from ..checkpoint.hub_source import resolve_hf_source
from ..checkpoint.mp_layout import RANK_FILE, resolve_iteration_dir
from ..checkpoint.load import saved_dtype
from ..checkpoint.mp_reader import MPCheckpoint
from ..errors import CheckpointError
from ..peft.adapter_files import SHARD_FILE as ADAPTER_SHARD
from ..checkpoint.parity import compare, prompt_ids, reference_outputs, sharded_outputs
from ..parallel.launch import spawn
from ..flags import Parser


def _text(ids: list[int], tok) -> str:
    return repr(tok.decode(ids)) if tok is not None else str(ids)


def _refuse_adapters_only(mp: str) -> None:
    """A LoRA/DoRA training checkpoint holds adapter shards and no model weights: say so, and what to run, rather
    than report its model files as missing."""
    try:
        folder = resolve_iteration_dir(Path(mp))
    except CheckpointError:
        return  # MPCheckpoint says what is wrong
    if list(folder.glob(f"mp_rank_*/{ADAPTER_SHARD}")) and not list(folder.glob(f"mp_rank_*/{RANK_FILE}")):
        raise CheckpointError(f"{folder}: a LoRA/DoRA training checkpoint (adapter shards on a frozen base, no model "
                              "weights), which verify cannot run; `hfmeg export OUT` writes the merged model "
                              "(OUT/hf) and the adapter, and `hfmeg convert to-mp` of OUT/hf gives a checkpoint to "
                              "verify")


def verify(args) -> int:
    _refuse_adapters_only(args.mp)
    layout = MPCheckpoint(args.mp).layout  # validates every rank file here, not inside the workers
    hf_dir = resolve_hf_source(args.hf)
    ids, tok = prompt_ids(args.mp, args.prompt, layout.model_config["vocab_size"])
    n, world = args.max_new_tokens, layout.tp * layout.pp
    under_launcher = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_launcher:
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        world = dist.get_world_size()
        ours = sharded_outputs(args.mp, ids, n)
    elif world > 1:
        ours = spawn(sharded_outputs, world, str(args.mp), ids, n)[0]
    else:
        ours = sharded_outputs(args.mp, ids, n)
    rc = 0
    if not under_launcher or dist.get_rank() == 0:
        report = compare(ours, reference_outputs(hf_dir, ids, n, saved_dtype(layout)), ids.shape[1], args.tol)
        print(f"layout: TP={layout.tp} PP={layout.pp} VPP={layout.vpp} on {world} process(es); prompt {ids.shape[1]} tokens")
        print(f"max_abs_logit_diff={report.max_abs_logit_diff:.3e}")
        print(f"transformers greedy: {_text(report.reference, tok)}")
        print(f"hfmeg greedy       : {_text(report.ours, tok)}")
        print("PARITY OK" if report.ok else f"PARITY FAILED (tol {args.tol:g}, continuations "
              f"{'equal' if report.ours == report.reference else 'differ'})")
        rc = 0 if report.ok else 1
    if under_launcher:
        box = [rc]
        dist.broadcast_object_list(box, src=0)
        rc = box[0]
        dist.destroy_process_group()
    return rc


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mp", required=True, help="MP checkpoint folder")
    ap.add_argument("--hf", required=True, help="HF folder or Hub id to compare with")
    ap.add_argument("--prompt", default="Once upon a time", help="prompt text (needs a tokenizer in the checkpoint)")
    ap.add_argument("--tol", type=float, default=1e-4, help="largest accepted max-abs logit difference")
    ap.add_argument("--max-new-tokens", type=int, default=20, help="greedy continuation length")
    args = ap.parse_args(argv)
    return run_cli(lambda: verify(args))
