"""All-or-nothing output folders.

Every converter writes into a hidden temporary sibling of its output folder and
renames it into place only when everything has been written. A crash, a bad input
found half-way or a full disk therefore leaves no half-written output behind:
the temporary folder is removed and the target is untouched. With `overwrite`,
an existing target is moved aside just before the rename and deleted after it.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import CheckpointError


def check_output(out: Path, *, overwrite: bool, inputs: tuple[Path, ...] = ()) -> Path:
    """Refuse an existing `out` without `overwrite`, and any `out` that overlaps an input folder."""
    out = Path(out).resolve()
    for src in inputs:
        src = Path(src).resolve()
        if out == src or src in out.parents or out in src.parents:
            raise CheckpointError(f"{out}: output folder overlaps the input {src}; choose another --out")
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out}: already exists (pass --overwrite to replace it)")
    return out


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished `tmp` to `out`, replacing what is there."""
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


@contextmanager
def atomic_output_dir(out: str | Path, *, overwrite: bool, inputs: tuple[Path, ...] = ()) -> Iterator[Path]:
    """Yield a temporary folder that becomes `out` when the block succeeds."""
    out = check_output(Path(out), overwrite=overwrite, inputs=inputs)
    created = [p for p in reversed(out.parents) if not p.exists()]
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise CheckpointError(f"{out}: cannot create the output folder ({e.strerror or e})") from e
    try:
        yield tmp
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for parent in reversed(created):  # parents we made for this output, innermost first
            try:
                parent.rmdir()
            except OSError:
                break
        raise
