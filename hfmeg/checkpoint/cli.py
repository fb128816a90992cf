"""Shared bits of the conversion command lines: argument types and the error contract.

Every hfmeg error (bad input, bad layout) becomes one line on stderr and exit
code 2; the library raises typed exceptions and the tools never print tracebacks
for them.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from ..errors import HfmegError


def pp_layers_arg(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer counts such as 11,11,10, got {text!r}")


def add_layout_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tp", type=int, required=True, help="tensor-parallel size")
    ap.add_argument("--pp", type=int, required=True, help="pipeline-parallel size")
    ap.add_argument("--vpp", type=int, default=1, help="virtual pipeline chunks per rank (interleaved 1F1B)")
    ap.add_argument("--pp-layers", type=pp_layers_arg, default=None,
                    help="layers per chunk in model order, e.g. 11,11,10 (default: even split)")


def add_output_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", required=True, help="output folder (written atomically)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                    help="dtype of the written tensors (auto: keep the source dtype)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing output folder")


def run_cli(fn: Callable[[], object]) -> int:
    """Run `fn`; an HfmegError prints one line to stderr and returns 2, else `fn`'s int result or 0."""
    try:
        rc = fn()
    except HfmegError as e:
        print("error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        return 2
    return rc if isinstance(rc, int) else 0
