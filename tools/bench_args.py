"""What the benchmark tools share: argument types (a bad value is argparse's one-line error, exit 2), the flags
and results of the tools that compare training runs' losses, the reshaped random architecture, and a process's
peak memory."""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path
from typing import Callable

import torch


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse `type` for integers >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def add_layout_model_args(ap: argparse.ArgumentParser, *, world: int, tp: int, hidden: int,
                          layers: int) -> None:
    """The layout (gloo ranks, TP, PP) and the random LLaMA shape (`bench_optimizer.make_model`) of the tools that
    train one."""
    ap.add_argument("--world", type=at_least(1), default=world, help="gloo ranks")
    ap.add_argument("--tp", type=at_least(1), default=tp)
    ap.add_argument("--pp", type=at_least(1), default=1)
    ap.add_argument("--hidden", type=at_least(64), default=hidden, help="multiple of 64 (64-wide heads)")
    ap.add_argument("--ffn", type=at_least(1), default=None)
    ap.add_argument("--layers", type=at_least(1), default=layers)


def add_loss_run_args(ap: argparse.ArgumentParser, *, seq_len: int, global_batch_size: int) -> None:
    """The flags of the tools that train on gloo ranks and compare the runs' loss curves."""
    ap.add_argument("--world", type=at_least(2), default=2, help="gloo ranks (data-parallel)")
    ap.add_argument("--steps", type=at_least(2), default=200)
    ap.add_argument("--seq-len", type=at_least(2), default=seq_len)
    ap.add_argument("--global-batch-size", type=at_least(1), default=global_batch_size)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=at_least(0), default=1234)
    ap.add_argument("--plot", type=Path, default=None, help="PNG of the loss curves")


FINAL_STEPS = 10  # a run's final loss is the mean over its last this many steps


def loss_curve(out: str | Path) -> list[float]:
    """The per-step training losses a trainer run wrote to `out`/metrics.jsonl."""
    from hfmeg.train.metrics import read_metrics

    return [r["loss"] for r in read_metrics(Path(out) / "metrics.jsonl") if "loss" in r]


def final_loss(losses: list[float]) -> float:
    """The mean of the last `FINAL_STEPS` losses."""
    tail = losses[-FINAL_STEPS:]
    return sum(tail) / len(tail)


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """`--hidden/--layers/--ffn/--heads`: reshape a random model's architecture (read by `shaped_config`)."""
    for flag in ("--hidden", "--layers", "--ffn", "--heads"):
        ap.add_argument(flag, type=at_least(1), default=None, help="override the config's shape")


def shape_of(a: argparse.Namespace) -> dict[str, int]:
    """The shape flags that were given, by flag name."""
    return {k: getattr(a, k) for k in ("hidden", "layers", "ffn", "heads") if getattr(a, k) is not None}


def shaped_config(source: str, a: argparse.Namespace, folder: Path) -> str:
    """`source` (HF folder or Hub id), or a copy of its config and tokenizer in `folder`, reshaped by the flags."""
    from hfmeg.checkpoint.hub_source import resolve_hf_source
    from hfmeg.checkpoint.mp_layout import copy_hf_side_files

    names = {"hidden": "hidden_size", "layers": "num_hidden_layers", "ffn": "intermediate_size"}
    shape = {names[k]: v for k, v in shape_of(a).items() if k in names}
    if a.heads is not None:
        shape.update(num_attention_heads=a.heads, num_key_value_heads=a.heads)
    if not shape:
        return source
    copy_hf_side_files(resolve_hf_source(source, weights=False), folder, carried=False)  # a config to reshape
    config = {**json.loads((folder / "config.json").read_text()), **shape}
    config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return str(folder)


def peak_bytes(device: torch.device) -> float:
    """This process's peak memory: CUDA bytes allocated on a GPU `device`, else its peak RSS."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # Linux: KiB
