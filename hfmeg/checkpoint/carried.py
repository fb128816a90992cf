"""Carried tensors: the HF tensors a checkpoint holds that hfmeg does not train, kept byte for byte.

They are a multimodal wrapper's other tensors (vision tower, projector, ...: `families/wrappers.py`) and those a
family's checkpoints hold that transformers does not compute with either (`FamilySpec.carried`: DeepSeek-V3's MTP
layers). Whatever folder a checkpoint's side files are copied from
(`mp_layout.copy_hf_side_files`), the carried tensors go with them into `hf/carried.safetensors`: taken from an HF
model folder's weights, or copied from an MP folder's `hf/`; the file's metadata records the wrapper's naming of the
text tensors. The export (`hf_writer.py`) writes them beside the trained text tensors, in their own dtype, and the
text tensors under the naming they were read with, so the folder loads with the original class.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from .hf_reader import BIN_INDEX, SAFE_INDEX, HFCheckpoint
from .st_stream import CODE_DTYPES, StreamingSafetensorsWriter, read_tensor

CARRIED_FILE = "carried.safetensors"
_NAMING = "text_naming"  # metadata key: the wrapper's (text model, LM head) prefixes as JSON, null for none


def _has_weights(folder: Path) -> bool:
    return any((folder / n).is_file() for n in ("model.safetensors", SAFE_INDEX, "pytorch_model.bin", BIN_INDEX))


def copy_carried(src: Path, dst: Path) -> None:
    """Put `src`'s carried tensors into `dst / CARRIED_FILE` (nothing where it has none)."""
    if (src / CARRIED_FILE).is_file():
        shutil.copyfile(src / CARRIED_FILE, dst / CARRIED_FILE)
        return
    if not _has_weights(src):
        return
    source = HFCheckpoint(src)
    if not source.carried and source.naming is None:
        return
    specs = {name: (source.dtype(name), tuple(source.shape(name))) for name in source.carried}
    with StreamingSafetensorsWriter(dst / CARRIED_FILE, specs, {"format": "pt", _NAMING: json.dumps(source.naming)}) as w:
        for name in source.carried:
            w.write(name, source.get(name).to(specs[name][0]))  # a quantized release's: dequantized (fp32 for FP8)


def carried_naming(hf_dir: Path) -> tuple[str, str] | None:
    """The wrapper's naming of the text tensors the carried file of `hf_dir` records (None: not a wrapper)."""
    path = hf_dir / CARRIED_FILE
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        naming = json.loads((f.metadata() or {}).get(_NAMING, "null"))
    return tuple(naming) if naming is not None else None


def carried_specs(hf_dir: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Name -> (dtype, shape) of the carried tensors of `hf_dir`, in file order."""
    path = hf_dir / CARRIED_FILE
    if not path.is_file():
        return {}
    with safe_open(str(path), framework="pt") as f:
        return {n: (CODE_DTYPES[f.get_slice(n).get_dtype()], tuple(f.get_slice(n).get_shape())) for n in f.keys()}


def read_carried(hf_dir: Path, name: str) -> torch.Tensor:
    return read_tensor(hf_dir / CARRIED_FILE, name)
