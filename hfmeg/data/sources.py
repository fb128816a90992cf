"""Reading raw records from Hub datasets and local files: the eval split, and each epoch's order.

Local files are read by index (`Table`): JSON lines and text by the byte offsets of their
lines (one scan on open, then a memory map), JSON arrays whole, parquet through a
memory-mapped Arrow table. hfmeg reads them itself rather than through `datasets`'
json loader because that aborts on the first malformed line without naming it: here a
malformed line becomes a `Raw` record carrying the problem and its `file:line`, and the
bad-data policy (report or fail) decides what happens to it. A source is the
concatenation of its files (folders and globs expand to sorted file lists), its records
numbered from 0 in that order.

**The eval split** (`data.eval_split`, a count or a fraction of each source) is drawn
once, as `datasets.Dataset.train_test_split(test_size=..., seed=data.seed)` draws its
test set: the first records of `numpy.random.default_rng(seed).permutation(n)`. The
other records are the training records; no epoch ever reads a held-out one. More than
half of a source held out is refused (`MAX_EVAL_FRACTION`).

**Epochs**: epoch e of source c reads its training records in the order
`default_rng([seed, c, e]).permutation(train)` (`data.shuffle`; in file order without
it), so an epoch's order follows from (seed, source, epoch) alone and a run resumes at
(epoch, records read) exactly, whatever the layout.

Hub datasets stream through `datasets.load_dataset(..., streaming=True)`: the first
`eval_split` records (a count: a stream has no length to take a fraction of) are held
out, the rest shuffled through `datasets`' shuffle buffer (`data.shuffle_buffer`, its
seed `set_epoch`-ed per epoch: `datasets` shuffles the shard order and fills the buffer
from it), and a resume skips the records already read with `IterableDataset.skip`.

File kinds: `.jsonl` is one JSON object per line; `.json` is a JSON array when its
first character is `[` (read whole: use JSONL for large data) and JSON lines
otherwise; `.txt` gives one `{"text": line}` record per non-blank line;
`.parquet` gives its rows.
"""

from __future__ import annotations

import glob
import json
import math
import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataError
from .config import SourceConfig

KINDS = {".jsonl": "jsonl", ".json": "json", ".txt": "txt", ".parquet": "parquet"}
MAX_EVAL_FRACTION = 0.5  # a larger hold-out leaves too little to train on: refused


@dataclass
class Raw:
    """One record as read: its location for messages, and the record or what is wrong with it."""

    where: str
    record: dict[str, Any] | None
    problem: str | None = None  # set for malformed records (the record is then None)


class _Lines:
    """A JSON-lines or text file by record: the byte span and line number of each non-blank line."""

    def __init__(self, path: Path, text: bool):
        self.path, self.text = path, text
        starts, ends, lines = [], [], []
        offset = 0
        with path.open("rb") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    starts.append(offset)
                    ends.append(offset + len(line.rstrip(b"\r\n")))
                    lines.append(lineno)
                offset += len(line)
        self.starts, self.ends, self.lines = (np.array(x, dtype=np.int64) for x in (starts, ends, lines))
        self._map: mmap.mmap | None = None

    def __len__(self) -> int:
        return len(self.starts)

    def get(self, i: int) -> Raw:
        if self._map is None:  # slices of a read-only map are safe from any thread
            with self.path.open("rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        line = self._map[self.starts[i]:self.ends[i]]
        where = f"{self.path}:{self.lines[i]}"
        if self.text:
            try:
                return Raw(where, {"text": line.decode("utf-8")})
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 text ({e})") from e
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return Raw(where, None, f"malformed JSON ({e})")
        if isinstance(rec, dict):
            return Raw(where, rec)
        return Raw(where, None, f"expected a JSON object, got {type(rec).__name__}")


class _Array:
    """A JSON array file, read whole."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.items = json.loads(path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{path}: malformed JSON array ({e})") from e

    def __len__(self) -> int:
        return len(self.items)

    def get(self, i: int) -> Raw:
        rec = self.items[i]
        if isinstance(rec, dict):
            return Raw(f"{self.path}[{i}]", rec)
        return Raw(f"{self.path}[{i}]", None, f"expected a JSON object, got {type(rec).__name__}")


class _Parquet:
    """A parquet file's rows, through a memory-mapped Arrow table."""

    def __init__(self, path: Path):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.path = path
        try:
            pq.ParquetFile(path).metadata  # the footer first: its error names what is wrong, not the mapping
            self.table = pq.read_table(path, memory_map=True)
        except (pa.ArrowException, OSError) as e:  # a damaged or truncated file: its footer is unreadable
            raise DataError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from e

    def __len__(self) -> int:
        return self.table.num_rows

    def get(self, i: int) -> Raw:
        return Raw(f"{self.path}[{i}]", self.table.slice(i, 1).to_pylist()[0])


def _open_file(path: Path) -> _Lines | _Array | _Parquet:
    kind = KINDS[path.suffix]
    if kind == "parquet":
        return _Parquet(path)
    if kind == "json":
        with path.open("rb") as f:
            if f.read(4096).lstrip().startswith(b"["):
                return _Array(path)
    return _Lines(path, text=kind == "txt")


class Table:
    """A local source's records by index: its files one after the other."""

    def __init__(self, files: list[Path]):
        self.files = [_open_file(f) for f in files]
        self.ends = np.cumsum([len(f) for f in self.files])

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def get(self, i: int) -> Raw:
        k = int(np.searchsorted(self.ends, i, side="right"))
        return self.files[k].get(i - (int(self.ends[k - 1]) if k else 0))


@lru_cache(maxsize=16)
def _cached_table(files: tuple[Path, ...], stamps: tuple[tuple[int, int], ...]) -> Table:
    return Table(list(files))


def open_table(files: list[Path]) -> Table:
    """The table of `files`, scanned once per process while they are unchanged (size and mtime): every evaluation
    and every reader of a run opens the same sources again."""
    stamps = tuple((f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _cached_table(tuple(files), stamps)


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


def held_out_count(eval_split: int | float, n: int, name: str) -> int:
    """How many of a source's `n` records `eval_split` holds out (a fraction rounds up, as `datasets` rounds it);
    more than `MAX_EVAL_FRACTION` of them is refused."""
    k = math.ceil(eval_split * n) if isinstance(eval_split, float) else eval_split
    if k > MAX_EVAL_FRACTION * n:
        raise DataError(f"data source {name}: data.eval_split {eval_split} holds out {k} of its {n} records, more "
                        f"than {MAX_EVAL_FRACTION:.0%}; set a smaller one (e.g. --set data.eval_split=0.05)")
    return k


class Source:
    """One configured training or eval source, number `number` of its list.

    `records(epoch, start)`: the training records of epoch `epoch` from the `start`-th on; `held_out()`: the eval
    split's records; `everything()`: every record in file order (an eval source); `train_size`: the training
    records per epoch (None for a Hub stream of unknown length); `held_size`: the held-out ones."""

    def __init__(self, cfg: SourceConfig, number: int = 0, *, seed: int = 0, eval_split: int | float = 0,
                 shuffle: bool = False, shuffle_buffer: int = 1000):
        self.cfg, self.number, self.seed = cfg, number, seed
        self.eval_split, self.shuffle, self.shuffle_buffer = eval_split, shuffle, shuffle_buffer
        self.files = local_files(cfg.path)
        self.name = cfg.path if self.files is not None else \
            f"{cfg.path}{f'[{cfg.config}]' if cfg.config else ''}:{cfg.split}"
        self._split: tuple[Table, np.ndarray, np.ndarray] | None = None

    # -- local files ------------------------------------------------------------------------
    def _local(self) -> tuple[Table, np.ndarray, np.ndarray]:
        """The table, the held-out indices (eval order) and the training indices (file order), made once."""
        if self._split is None:
            table = open_table(self.files)
            n = len(table)
            k = held_out_count(self.eval_split, n, self.name)
            if k:
                perm = np.random.default_rng(self.seed).permutation(n)  # datasets' train_test_split
                self._split = (table, perm[:k], np.sort(perm[k:]))
            else:
                self._split = (table, np.arange(0), np.arange(n))
        return self._split

    @cached_property
    def train_size(self) -> int | None:
        if self.files is not None:
            return len(self._local()[2])
        info = self._stream().info.splits
        split = info.get(self.cfg.split) if info else None
        return None if split is None or not split.num_examples else split.num_examples - self._hub_held()

    @property
    def held_size(self) -> int:
        return self._hub_held() if self.files is None else len(self._local()[1])

    def records(self, epoch: int = 0, start: int = 0) -> Iterator[Raw]:
        if self.files is None:
            yield from self._hub(epoch, start)
            return
        table, _, train = self._local()
        order = np.random.default_rng([self.seed, self.number, epoch]).permutation(train) if self.shuffle else train
        for i in order[start:].tolist():
            yield table.get(i)

    def held_out(self) -> Iterator[Raw]:
        if self.files is None:
            yield from self._hub_indexed(self._stream().take(self._hub_held()), 0)
            return
        table, held, _ = self._local()
        for i in held.tolist():
            yield table.get(i)

    def everything(self) -> Iterator[Raw]:
        if self.files is None:
            yield from self._hub_indexed(self._stream(), 0)
            return
        table = open_table(self.files)
        for i in range(len(table)):
            yield table.get(i)

    # -- Hub streams ------------------------------------------------------------------------
    def _stream(self):
        import datasets

        c = self.cfg
        try:
            return datasets.load_dataset(c.path, c.config, split=c.split, revision=c.revision, streaming=True)
        except Exception as e:  # network, auth, missing dataset/config/split: one line naming the source
            from huggingface_hub import constants

            if constants.HF_HUB_OFFLINE and "OfflineModeIsEnabled" in str(e):
                raise DataError(f"data source {self.name}: not in the local cache, and HF_HUB_OFFLINE is set (the "
                                "Hub is not asked); unset it to download, or give a local file") from e
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise DataError(f"data source {self.name}: cannot open Hub dataset ({type(e).__name__}: {first})") from e

    def _hub_held(self) -> int:
        if isinstance(self.eval_split, float):
            raise DataError(f"data source {self.name}: a streamed Hub dataset has no length to take a fraction of; "
                            "give data.eval_split as a count of records")
        return self.eval_split

    def _hub(self, epoch: int, start: int) -> Iterator[Raw]:
        held = self._hub_held()
        ds = self._stream()
        ds = ds.skip(held) if held else ds
        if self.shuffle:
            seed = int(np.random.SeedSequence([self.seed, self.number]).generate_state(1)[0])
            ds = ds.shuffle(seed=seed, buffer_size=self.shuffle_buffer)
        ds = ds.skip(start) if start else ds
        ds.set_epoch(epoch)  # last: a dataset made by skip() starts again at epoch 0
        yield from self._hub_indexed(ds, start)

    def _hub_indexed(self, ds, start: int) -> Iterator[Raw]:
        for i, rec in enumerate(ds, start):
            yield Raw(f"{self.name}#{i}", rec)
