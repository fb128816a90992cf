"""Reading raw records from Hub datasets and local files, resumable by record index.

Hub datasets and local parquet files stream through
`datasets.load_dataset(..., streaming=True)`. Local JSON, JSONL and text files are
read by hfmeg's own line reader instead, because `datasets`' json loader aborts on
the first malformed line without naming it: here a malformed line becomes a
`Raw` record carrying the problem and its `file:line`, and the bad-data policy
(report or fail) decides what happens to it.

A source is the concatenation of its files (folders and globs expand to sorted
file lists); its records are numbered from 0 in that order, and
`Source.records(start)` resumes at record `start`. Skipping re-reads lines without
parsing them (JSONL/text), slices arrays (JSON), skips whole parquet files by their
row count, and uses `IterableDataset.skip` for the Hub.

File kinds: `.jsonl` is one JSON object per line; `.json` is a JSON array when its
first character is `[` (read whole: use JSONL for large data) and JSON lines
otherwise; `.txt` gives one `{"text": line}` record per non-blank line;
`.parquet` gives its rows.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DataError
from .config import SourceConfig

KINDS = {".jsonl": "jsonl", ".json": "json", ".txt": "txt", ".parquet": "parquet"}


@dataclass
class Raw:
    """One record as read: its location for messages, and the record or what is wrong with it."""

    where: str
    record: dict[str, Any] | None
    problem: str | None = None  # set for malformed records (the record is then None)


Reader = Generator[Raw, None, int]  # yields records from `skip` on, returns the file's record count


def _json_lines(path: Path, lines: Iterator[bytes], skip: int) -> Reader:
    index = 0
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        index += 1
        if index <= skip:
            continue
        where = f"{path}:{lineno}"
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            yield Raw(where, None, f"malformed JSON ({e})")
            continue
        if isinstance(rec, dict):
            yield Raw(where, rec)
        else:
            yield Raw(where, None, f"expected a JSON object, got {type(rec).__name__}")
    return index


def _read_jsonl(path: Path, skip: int) -> Reader:
    with path.open("rb") as f:
        return (yield from _json_lines(path, f, skip))


def _read_json(path: Path, skip: int) -> Reader:
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"["):
        return (yield from _read_jsonl(path, skip))
    try:
        items = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: malformed JSON array ({e})") from e
    for i in range(skip, len(items)):
        rec = items[i]
        if isinstance(rec, dict):
            yield Raw(f"{path}[{i}]", rec)
        else:
            yield Raw(f"{path}[{i}]", None, f"expected a JSON object, got {type(rec).__name__}")
    return len(items)


def _read_txt(path: Path, skip: int) -> Reader:
    index = 0
    with path.open("r", encoding="utf-8", errors="strict") as f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                index += 1
                if index > skip:
                    yield Raw(f"{path}:{lineno}", {"text": line.rstrip("\r\n")})
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text after line {index} ({e})") from e
    return index


def _read_parquet(path: Path, skip: int) -> Reader:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowException, OSError) as e:  # a damaged or truncated file: its footer is unreadable
        raise DataError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from e
    if skip < rows:
        ds = datasets.load_dataset("parquet", data_files=str(path), split="train", streaming=True)
        try:
            for i, rec in enumerate(ds.skip(skip), skip):
                yield Raw(f"{path}[{i}]", rec)
        except (pa.ArrowException, OSError) as e:  # a damaged row group
            raise DataError(f"{path}: unreadable Parquet data ({str(e).splitlines()[0]})") from e
    return rows


READERS = {"jsonl": _read_jsonl, "json": _read_json, "txt": _read_txt, "parquet": _read_parquet}


def local_files(path: str) -> list[Path] | None:
    """The files a local source names (sorted), or None when `path` is a Hub dataset id."""
    p = Path(path).expanduser()
    if any(c in path for c in "*?["):
        files = [Path(f) for f in sorted(glob.glob(str(p), recursive=True)) if Path(f).is_file()]
        files = [f for f in files if f.suffix in KINDS]
        if not files:
            raise DataError(f"data source {path!r}: the glob matches no {'/'.join(KINDS)} file")
        return files
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in KINDS)
        if not files:
            raise DataError(f"data source {path!r}: the folder holds no {'/'.join(KINDS)} file")
        return files
    if p.is_file():
        if p.suffix not in KINDS:
            raise DataError(f"data source {path!r}: unknown file type {p.suffix!r} (known: {', '.join(KINDS)})")
        return [p]
    if p.suffix in KINDS or path.startswith((".", "/", "~")):
        raise DataError(f"data source {path!r}: no such file or folder")
    return None


class Source:
    """One configured source; `records(start)` iterates one epoch from record `start`."""

    def __init__(self, cfg: SourceConfig):
        self.cfg = cfg
        self.files = local_files(cfg.path)
        self.name = cfg.path if self.files is not None else f"{cfg.path}[{cfg.config or ''}]:{cfg.split}"

    def records(self, start: int = 0) -> Iterator[Raw]:
        if self.files is None:
            yield from self._hub(start)
            return
        offset = 0
        for f in self.files:
            offset += yield from READERS[KINDS[f.suffix]](f, max(0, start - offset))

    def _hub(self, start: int) -> Iterator[Raw]:
        import datasets

        c = self.cfg
        try:
            ds = datasets.load_dataset(c.path, c.config, split=c.split, revision=c.revision, streaming=True)
        except Exception as e:  # network, auth, missing dataset/config/split: one line naming the source
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise DataError(f"data source {self.name}: cannot open Hub dataset ({type(e).__name__}: {first})") from e
        for i, rec in enumerate(ds.skip(start) if start else ds, start):
            yield Raw(f"{self.name}#{i}", rec)
