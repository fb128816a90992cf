"""Argument types shared by the benchmark tools: a bad value is argparse's one-line error, exit 2."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable


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


def add_loss_run_args(ap: argparse.ArgumentParser, *, seq_len: int, global_batch_size: int) -> None:
    """The flags of the tools that train on gloo ranks and compare the runs' loss curves."""
    ap.add_argument("--world", type=at_least(2), default=2, help="gloo ranks (data-parallel)")
    ap.add_argument("--steps", type=at_least(2), default=200)
    ap.add_argument("--seq-len", type=at_least(2), default=seq_len)
    ap.add_argument("--global-batch-size", type=at_least(1), default=global_batch_size)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=at_least(0), default=1234)
    ap.add_argument("--plot", type=Path, default=None, help="PNG of the loss curves")
