"""Shared bits of the conversion command lines: argument types and the error contract.

Every hfmeg error (bad input, bad layout) becomes one line on stderr and exit
code 2; the library raises typed exceptions and the tools never print tracebacks
for them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
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


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def describe_output(folder: Path) -> str:
    """One line saying what a converter wrote: the folder, its files and their size."""
    files = [p for p in folder.rglob("*") if p.is_file()]
    weights = [p for p in files if p.suffix == ".safetensors"]
    total = sum(p.stat().st_size for p in files)
    return (f"wrote {folder}: {len(files)} files ({len(weights)} safetensors, "
            f"{_size(sum(p.stat().st_size for p in weights))}), {_size(total)} in all")


def run_cli(fn: Callable[[], object]) -> int:
    """Run `fn`, the whole of a converter; returns the exit code.

    A returned folder is described on stdout. An HfmegError, or an OSError no deeper
    layer named (a full disk, read-only storage), prints one line to stderr and returns
    2; Ctrl-C returns 130 (128 + SIGINT). The converters write atomically, so in every
    failing case nothing was written."""
    try:
        rc = fn()
    except HfmegError as e:
        print("error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        return 2
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}; no output written", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; no output written", file=sys.stderr)
        return 130
    if isinstance(rc, Path):
        print(describe_output(rc))
        return 0
    return rc if isinstance(rc, int) else 0
