"""All-or-nothing output folders.

Every converter writes into a hidden temporary sibling of its output folder and
renames it into place only when everything has been written. A crash, a bad input
found half-way or a full disk therefore leaves no half-written output behind:
the temporary folder is removed and the target is untouched. With `overwrite`,
an existing target is moved aside just before the rename and deleted after it.

A rename is only as durable as what it points at: without an fsync, a power loss
after the rename can leave the new name pointing at files whose data never reached
the disk. So every file and folder of the temporary tree is fsync'ed before the
rename, and the parent folder (which holds the new name) right after it.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from safetensors.torch import save_file

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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()  # what open() gives a new file: the mode every file hfmeg writes ends up with


def save_tensors(tensors: dict, path: Path, metadata: dict[str, str]) -> None:
    """`safetensors.torch.save_file` with the mode of any other file the run writes (it creates 0600 files)."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, FILE_MODE)


def fsync_path(path: Path) -> None:
    """Flush one file's data, or one folder's entries, to stable storage."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every folder bottom-up (a folder after its entries)."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(Path(folder) / name)
        fsync_path(Path(folder))


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path`'s content atomically and durably (write a sibling, fsync it, rename, fsync the
    folder), so after a crash or power loss the file holds the old or the new text, whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    fsync_path(tmp)
    tmp.replace(path)
    fsync_path(path.parent)


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished `tmp` to `out` durably, replacing what is there."""
    fsync_tree(tmp)
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
        os.rename(tmp, out)
        fsync_path(out.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)
        fsync_path(out.parent)


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
