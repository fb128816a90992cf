"""The recipes' command line: a YAML config plus flags, each flag one dotted override.

    recipes/sft_llama13b.py --model meta-llama/Llama-2-13b-hf --data tatsu-lab/alpaca \
        --tp 2 --pp 2 --max-steps 30 --out OUT --set optim.weight_decay=0.01

Launch with `accelerate launch` or `torchrun`; a plain `python` run is a world of one.
Bad configs exit with code 2 and one line naming the field.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..errors import HfmegError
from .config import TrainConfig, load_config

# flag -> (dotted config key, type, help)
FLAGS = {
    "--model": ("model.path", str, "HF folder, Hub id, or hfmeg shard folder"),
    "--tp": ("parallel.tp", int, "tensor-parallel size"),
    "--pp": ("parallel.pp", int, "pipeline-parallel size"),
    "--vpp": ("parallel.vpp", int, "virtual pipeline chunks per rank (interleaved 1F1B when > 1)"),
    "--schedule": ("parallel.schedule", str, "gpipe | 1f1b | interleaved"),
    "--seq-len": ("data.seq_len", int, "tokens per packed row"),
    "--micro-batch-size": ("train.micro_batch_size", int, "rows per micro-batch"),
    "--global-batch-size": ("train.global_batch_size", int, "rows per optimizer step, all DP ranks"),
    "--max-steps": ("train.max_steps", int, "optimizer steps"),
    "--eval-every": ("train.eval_every", int, "evaluate every N steps (0: never)"),
    "--lr": ("optim.lr", float, "peak learning rate"),
    "--warmup-steps": ("lr.warmup_steps", int, "linear warm-up steps"),
    "--dtype": ("model.dtype", str, "bf16 | fp16 | fp32 (default: bf16 on GPUs, fp32 on CPU)"),
    "--optimizer": ("optim.mode", str, "overlapped | distributed | ddp"),
    "--recompute": ("model.recompute", str, "none | selective | full"),
    "--seed": ("train.seed", int, "random seed"),
    "--save-every": ("checkpoint.save_every", int, "checkpoint every N steps (0: only at the end)"),
    "--keep-last": ("checkpoint.keep_last", int, "checkpoints to keep"),
    "--resume": ("checkpoint.resume", str, "none | auto | path to a checkpoint iteration folder"),
    "--out": ("checkpoint.out", str, "output folder (metrics, checkpoints, hf/)"),
    "--push-to-hub": ("hub.push_to_hub", str, "Hub repo id to upload the exported model to"),
}


def parser(description: str, default_config: Path) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(default_config), help="YAML config (default: %(default)s)")
    ap.add_argument("--data", action="append", help="data source (Hub id, file, folder or glob); repeatable")
    ap.add_argument("--format", help="data format: alpaca | messages | sharegpt | text")
    for flag, (key, typ, text) in FLAGS.items():
        ap.add_argument(flag, type=typ, help=f"{text} [{key}]")
    ap.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                    help="sequence parallelism inside TP regions [parallel.sequence_parallel]")
    ap.add_argument("--private", action="store_true", default=None, help="create the Hub repo private [hub.private]")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other dotted override")
    return ap


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    overrides = {key: getattr(args, flag[2:].replace("-", "_")) for flag, (key, _, _) in FLAGS.items()}
    overrides["parallel.sequence_parallel"] = args.sequence_parallel
    overrides["hub.private"] = args.private
    overrides["data.format"] = args.format
    if args.data:
        overrides["data.sources"] = [{"path": d} for d in args.data]
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise HfmegError(f"--set {item!r}: expected KEY=VALUE")
        overrides[key] = value
    return load_config(args.config, overrides)


def fit_to_model(cfg: TrainConfig) -> None:
    """CPU runs of a GPU recipe: no torch.compile (GPU kernels), and a sequence the model supports."""
    from ..checkpoint.hub_source import resolve_hf_source
    from ..config import load_hf_config, model_config_from_hf

    if not torch.cuda.is_available() and cfg.model.compile:
        print("model.compile: torch.compile kernels are for GPUs; running eagerly on CPU")
        cfg.model.compile = False
    try:
        max_pos = model_config_from_hf(load_hf_config(resolve_hf_source(cfg.model.path))).max_positions
    except HfmegError:
        return  # an MP checkpoint folder, or an error the trainer reports with full context
    if cfg.data.seq_len > max_pos:
        print(f"data.seq_len {cfg.data.seq_len} > the model's max_position_embeddings {max_pos}: using {max_pos}")
        cfg.data.seq_len = max_pos


def main(description: str, default_config: Path, argv: list[str] | None = None) -> int:
    from .trainer import Trainer

    args = parser(description, default_config).parse_args(argv)
    try:
        cfg = config_from_args(args)
        fit_to_model(cfg)
        result = Trainer(cfg).run()
    except HfmegError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if result.hf_folder is not None and result.is_logger:
        print(f"exported: {result.hf_folder}")
    return 0
