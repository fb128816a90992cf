"""Durability of atomic output: data and names are fsync'ed before a rename makes them visible.

Each test records the order of fsync and rename calls (an fsync'ed descriptor is mapped back
to its path through /proc/self/fd) and checks that nothing is renamed into place before it is
on stable storage, and that the rename itself is flushed (its parent folder fsync'ed) before
the function returns, i.e. before the `latest` pointer can name it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hfmeg.checkpoint.atomic import replace_dir
from hfmeg.checkpoint.mp_layout import LATEST_FILE, write_latest

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd (Linux)")


@pytest.fixture
def events(monkeypatch) -> list[tuple[str, str]]:
    log: list[tuple[str, str]] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst, *a, **k):
        log.append(("rename", str(Path(dst).resolve())))
        real_rename(src, dst, *a, **k)

    def replace(src, dst, *a, **k):
        log.append(("rename", str(Path(dst).resolve())))
        real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    return log


def _tree(tmp: Path) -> set[str]:
    (tmp / "sub").mkdir(parents=True)
    (tmp / "a.bin").write_bytes(b"a" * 100)
    (tmp / "sub" / "b.json").write_text("{}")
    return {str(p.resolve()) for p in [tmp, tmp / "sub", tmp / "a.bin", tmp / "sub" / "b.json"]}


@pytest.mark.parametrize("existing", [False, True])
def test_replace_dir_flushes_the_tree_before_the_rename_and_the_name_after(tmp_path, events, existing):
    out = tmp_path / "out"
    if existing:
        out.mkdir()
        (out / "old").write_text("old")
    paths = _tree(tmp_path / ".out.tmp")
    replace_dir(tmp_path / ".out.tmp", out)
    into_place = events.index(("rename", str(out.resolve())))
    flushed = {p for kind, p in events[:into_place] if kind == "fsync"}
    assert paths <= flushed, (paths - flushed, events)
    assert ("fsync", str(tmp_path.resolve())) in events[into_place + 1:], events
    assert (out / "sub" / "b.json").read_text() == "{}" and not (out / "old").exists()


def test_write_latest_flushes_the_pointer_and_its_folder(tmp_path, events):
    write_latest(tmp_path, 7)
    latest = str((tmp_path / LATEST_FILE).resolve())
    into_place = events.index(("rename", latest))
    assert ("fsync", str((tmp_path / f".{LATEST_FILE}.tmp").resolve())) in events[:into_place], events
    assert ("fsync", str(tmp_path.resolve())) in events[into_place + 1:], events
    assert (tmp_path / LATEST_FILE).read_text() == "7\n"
