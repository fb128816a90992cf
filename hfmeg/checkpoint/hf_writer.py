"""Write an HF checkpoint folder from an MP checkpoint, streaming.

The HF tensor names, shapes and dtypes are known up front (`MPCheckpoint.shape` /
`dtype`, computed from the rank files' headers; any `ShardView`, also a run's live
shards, `live_shards.py`), so the shard plan is made before any data is read:
tensors in model order fill `model-0000i-of-0000n.safetensors` files up to
`max_shard_bytes` (a single `model.safetensors` when everything fits), with a
`model.safetensors.index.json` when there are several. Each tensor is
merged from its TP slices and written (by a write-behind thread, so the next
merge overlaps this write) and dropped.

`config.json` keeps every field of the source config; only `torch_dtype` / `dtype`
are set to what was written, and a `quantization_config` is dropped: hfmeg reads a quantized release dequantized
(`quantized.py`) and writes float tensors back, so the export is the dequantized model. Tokenizer and generation config files are copied
verbatim. A multimodal wrapper's text tensors get the names they were read with, and the
carried tensors (`carried.py`: the wrapper's other towers, a family's untrained extras) are
written after them as stored, in their own dtype.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import torch

from ..errors import HfmegError
from ..families.wrappers import stored_name
from .carried import carried_naming, carried_specs, read_carried
from .mp_layout import copy_hf_side_files, dtype_name
from .mp_reader import ShardView
from .st_stream import StreamingSafetensorsWriter, WriteBehind

SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value: str | int) -> int:
    """'5GB' -> 5e9 bytes (decimal units as on the Hub; KiB/MiB/GiB are binary)."""
    if isinstance(value, int):
        size = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
        if not m or m.group(2).upper() not in SIZE_UNITS:
            raise HfmegError(f"--max-shard-size {value!r}: expected a size such as 5GB, 500MB or 2GiB")
        size = int(float(m.group(1)) * SIZE_UNITS[m.group(2).upper()])
    if size < 1:
        raise HfmegError(f"--max-shard-size {value!r}: must be positive")
    return size


def plan_shards(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], max_bytes: int) -> list[list[str]]:
    """Group tensor names, in order, into shards of at most `max_bytes` (a bigger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, (dtype, shape) in specs.items():
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_config(src: Path, dst: Path, dtype: str) -> None:
    """Copy config.json keeping every field but `quantization_config` (the tensors written are not quantized); set
    the dtype field(s) it has (both when it has neither)."""
    cfg = json.loads(src.read_text())
    cfg.pop("quantization_config", None)
    for key in [k for k in ("torch_dtype", "dtype") if k in cfg] or ["torch_dtype", "dtype"]:
        cfg[key] = dtype
    dst.write_text(json.dumps(cfg, indent=2) + "\n")


def exported_names(source: ShardView) -> dict[str, str]:
    """{the export's name: the source's HF name} of every trained tensor, in model order: a multimodal wrapper's
    text tensors under the naming they were read with (the carried file's record), others as they are."""
    naming = carried_naming(source.hf_dir)
    return {stored_name(n, naming): n for n in source.hf_names()}


def write_hf_folder(source: ShardView, folder: Path, dtype: torch.dtype | None, max_shard_bytes: int) -> None:
    text = exported_names(source)
    carried = carried_specs(source.hf_dir)
    specs = {k: (dtype or source.dtype(n), source.shape(n)) for k, n in text.items()} | carried
    shards = plan_shards(specs, max_shard_bytes)
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for file, names in zip(files, shards):
        with StreamingSafetensorsWriter(folder / file, {k: specs[k] for k in names}, {"format": "pt"}) as writer, \
                WriteBehind(depth=1) as behind:
            for name in names:
                tensor = read_carried(source.hf_dir, name) if name in carried else source.get(text[name])
                behind.write(writer, name, tensor.to(specs[name][0]))
    if n > 1:
        total = sum(torch.Size(s).numel() * d.itemsize for d, s in specs.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: file for file, names in zip(files, shards) for name in names}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    copy_hf_side_files(source.hf_dir, folder, carried=False)
    main_dtype = Counter(d for k, (d, _) in specs.items() if k in text).most_common(1)[0][0]
    write_config(source.hf_dir / "config.json", folder / "config.json", dtype_name(main_dtype))
