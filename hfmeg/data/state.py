"""The resumable data position, as plain JSON-able data.

`{"version", "fingerprint", "step", "position": {draws, epochs, index},
"packer": {open, ready}, "report": {...}}`: the mixture's draw count and each
source's (epoch, records read), the documents already read but not yet handed out
in a row (the packer's carry-over), and the cumulative bad-data counts. Nothing in
it depends on TP/PP/DP, so a run may resume with another DP size. Records read
ahead but not yet consumed are not part of it: they are read again on resume.

`fingerprint` covers the config fields that change what the stream contains
(sources, formats, seq_len, packing, masking, seed, shuffle, eval split); resuming under a different one
is refused with a message instead of silently yielding other batches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from ..errors import DataError
from .config import DataConfig
from .mixing import Position

VERSION = 2  # 1: before the eval split and the epochs' shuffle
_STREAM_FIELDS = ("sources", "format", "system_prompt", "train_on_prompt", "seq_len", "packing", "overlong",
                  "seed", "shuffle", "shuffle_buffer", "eval_split")


def fingerprint(cfg: DataConfig) -> str:
    data = {k: v for k, v in dataclasses.asdict(cfg).items() if k in _STREAM_FIELDS}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def position_out(p: Position) -> dict[str, Any]:
    return {"draws": p.draws, "epochs": list(p.epochs), "index": list(p.index)}


def position_in(d: dict[str, Any]) -> Position:
    return Position(int(d["draws"]), [int(x) for x in d["epochs"]], [int(x) for x in d["index"]])


def check_state(d: dict[str, Any], cfg: DataConfig) -> None:
    version = d.get("version") if isinstance(d, dict) else None
    if version != VERSION:
        raise DataError(f"data state: expected version {VERSION}, got {version!r}")
    if d.get("fingerprint") != fingerprint(cfg):
        raise DataError("data state was saved with a different data config (sources, format, seq_len, packing, "
                        "masking, seed, shuffle or eval_split changed); it cannot resume this stream")
