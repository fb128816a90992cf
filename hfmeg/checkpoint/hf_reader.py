"""Lazy, validated reading of a Hugging Face checkpoint folder.

Tensors are read one at a time with `safetensors.safe_open`, so a rank (or the
converter) touches only the bytes it needs. Legacy `pytorch_model*.bin` files are
opened with `torch.load(weights_only=True, mmap=True)`: never unpickled code, and
memory-mapped so they stay lazy too.

A multimodal wrapper's checkpoint (`families/wrappers.py`) is read as its language model: its text tensors under the
text model's own names (`model.layers.…`, `lm_head.…`), so the family's rules apply unchanged; its other tensors
(`carried`), and those the family carries (`FamilySpec.carried`), travel verbatim (`checkpoint/carried.py`).

A quantized release (`quantization_config`: gpt-oss's MXFP4 experts, DeepSeek-V3's and Qwen3-FP8's block-scaled
FP8, a `*-bnb-4bit` repo's bitsandbytes 4-bit linears) is read as the float model it encodes: `quantized.py` pairs
each quantized tensor with its scales and dequantizes it when it is read, under the name transformers gives the
float tensor. A QLoRA run reads bitsandbytes' 4-bit tensors as they are instead (`packed_4bit`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError, UnsupportedConfigError
from ..families import family_of, wrapper_of
from ..families.wrappers import TEXT_NAMINGS, text_name
from ..quant.formats import QuantFormat, quant_format
from ..quant.nf4 import Packed4bit
from .quantized import QuantizedTensors
from .st_stream import CODE_DTYPES, read_tensor

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


def folder_quant_format(folder: Path, config: object) -> QuantFormat | None:
    """The format of `folder`'s `quantization_config` (`quant/formats.py`), refused naming the folder's config."""
    try:
        return quant_format(config)
    except UnsupportedConfigError as e:
        raise UnsupportedConfigError(f"{Path(folder) / str(e)}") from e


class HFCheckpoint:
    """Name -> tensor access over single or sharded safetensors (or .bin) files."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder}: no such folder")
        self._files: dict[str, Path] = {}  # tensor name -> file
        self._handles: dict[Path, object] = {}
        self._index()
        self._view()

    def _index(self) -> None:
        f = self.folder
        for index_name in (SAFE_INDEX, BIN_INDEX):
            index = f / index_name
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise CheckpointError(f"{index}: not a valid index file ({e})") from e
                for name, file in weight_map.items():
                    path = f / file
                    if not path.is_file():
                        raise CheckpointError(f"{index}: names {file} for {name}, which does not exist")
                    self._files[name] = path
                return
        singles = [f / "model.safetensors", f / "pytorch_model.bin"]
        for path in singles:
            if path.is_file():
                for name in self._open(path).keys():
                    self._files[name] = path
                return
        raise CheckpointError(f"{f}: no weights found (model.safetensors, {SAFE_INDEX} or pytorch_model.bin)")

    def _view(self) -> None:
        """The text model's names of the stored tensors (`_stored`), the wrapper's naming and the carried tensors."""
        config = self.folder / "config.json"
        try:
            meta = json.loads(config.read_text()) if config.is_file() else {}
        except (json.JSONDecodeError, OSError):
            meta = {}  # load_hf_config names the problem where the config is read
        self.naming: tuple[str, str] | None = None
        self.quantized: QuantizedTensors | None = None
        top = meta
        if wrapper_of(meta.get("model_type")) is not None:
            found = [n for n in TEXT_NAMINGS if n[0] + "embed_tokens.weight" in self._files]
            if not found:
                raise CheckpointError(f"{self.folder}: a {meta['model_type']} checkpoint without its language model's "
                                      f"embedding ({' or '.join(n[0] + 'embed_tokens.weight' for n in TEXT_NAMINGS)})")
            self.naming, meta = found[0], meta.get("text_config") or {}
        names = {k: text_name(k, self.naming) for k in self._files}
        self._stored = {name: k for k, name in names.items() if name is not None}
        self.carried = [k for k, name in names.items() if name is None]  # the wrapper's other tensors
        self._dequantized(top, meta)
        try:
            family = family_of(meta.get("model_type"))
        except UnsupportedConfigError:
            return  # refused with its config line by whoever normalises the config
        self.carried += [self._stored[n] for n in self._stored if family.carried(n, meta)]

    def _dequantized(self, top: dict, meta: dict) -> None:
        """Read a quantized release's tensors dequantized, under the float tensors' names (`quantized.py`)."""
        fmt = folder_quant_format(self.folder, top.get("quantization_config"))
        if fmt is None:
            return
        # the dtype the release declares (its unquantized tensors'); gpt-oss declares none and stores them in bf16
        name = top.get("torch_dtype") or top.get("dtype") or meta.get("torch_dtype") or meta.get("dtype")
        declared = getattr(torch, name, None) if isinstance(name, str) else None
        declared = declared if isinstance(declared, torch.dtype) else torch.bfloat16
        raw = dict(self._stored)
        self.quantized = QuantizedTensors(fmt, self.folder, list(raw), lambda n: self._raw_shape(raw[n]),
                                          lambda n: self._raw_dtype(raw[n]), declared, lambda n: self._raw_get(raw[n]))
        self._raw_names = raw
        for name in self.quantized.hidden():
            del self._stored[name]
        self._stored.update({name: name for name in self.quantized.pairs})

    def _open(self, path: Path):
        if path not in self._handles:
            try:
                if path.suffix == ".safetensors":
                    self._handles[path] = safe_open(str(path), framework="pt")
                else:
                    self._handles[path] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except (SafetensorError, OSError, RuntimeError, Exception) as e:
                raise CheckpointError(f"{path}: cannot read weights ({type(e).__name__}: {e})") from e
        return self._handles[path]

    def keys(self) -> list[str]:
        """The text model's tensors by its names, and the carried ones by theirs."""
        text = set(self._stored.values())
        return list(self._stored) + [k for k in self.carried if k not in text]

    def resolve(self, name: str) -> str:
        """The stored name of tensor `name` (the text model's name, or a carried one's own)."""
        if name in self._stored:
            return self._stored[name]
        if name in self.carried:
            return name
        # GPT-2 checkpoints from the original release store names without `transformer.`.
        if name.startswith("transformer.") and name[len("transformer.") :] in self._stored:
            return name[len("transformer.") :]
        raise CheckpointError(f"{self.folder}: tensor {name} is missing from the checkpoint")

    def __contains__(self, name: str) -> bool:
        try:
            self.resolve(name)
            return True
        except CheckpointError:
            return False

    def _dequantizes(self, name: str) -> bool:
        return self.quantized is not None and name in self.quantized.pairs

    def get(self, name: str) -> torch.Tensor:
        if self._dequantizes(name):
            return self.quantized.get(name, lambda n: self._raw_get(self._raw_names[n]))
        return self._raw_get(self.resolve(name))

    def stored_4bit(self, name: str) -> bool:
        """Whether tensor `name` is stored as bitsandbytes 4-bit codes (a `*-bnb-4bit` checkpoint's linears)."""
        return self._dequantizes(name) and self.quantized.stored_4bit(name)

    def packed_4bit(self, name: str) -> Packed4bit:
        """The bitsandbytes 4-bit tensor `name` as stored (`stored_4bit`), for a 4-bit base: not dequantized."""
        return self.quantized.packed(name, lambda n: self._raw_get(self._raw_names[n]))

    def _raw_get(self, key: str) -> torch.Tensor:
        path = self._files[key]
        handle = self._open(path)
        try:
            if path.suffix == ".safetensors":
                return read_tensor(path, key)  # not handle.get_tensor: see st_stream.read_tensor
            return handle[key]
        except (SafetensorError, OSError, RuntimeError, KeyError) as e:
            raise CheckpointError(f"{path}: cannot read tensor {key} ({type(e).__name__}: {e})") from e

    def shape(self, name: str) -> tuple[int, ...]:
        if self._dequantizes(name):
            return self.quantized.shape(name)
        return self._raw_shape(self.resolve(name))

    def _raw_shape(self, key: str) -> tuple[int, ...]:
        path = self._files[key]
        handle = self._open(path)
        if path.suffix == ".safetensors":
            return tuple(handle.get_slice(key).get_shape())
        return tuple(handle[key].shape)

    def dtype(self, name: str) -> torch.dtype:
        if self._dequantizes(name):
            return self.quantized.dtype(name)
        return self._raw_dtype(self.resolve(name))

    def _raw_dtype(self, key: str) -> torch.dtype:
        path = self._files[key]
        handle = self._open(path)
        if path.suffix == ".safetensors":
            code = handle.get_slice(key).get_dtype()
            if code not in CODE_DTYPES:
                raise CheckpointError(f"{path}: tensor {key} is stored as {code}, which hfmeg cannot read "
                                      f"(it reads {', '.join(CODE_DTYPES)})")
            return CODE_DTYPES[code]
        return handle[key].dtype

    def files(self) -> list[Path]:
        return sorted(set(self._files.values()))
