"""The Megatron-style shard layout on disk.

```
<dir>/latest_checkpointed_iteration.txt      "release" or the iteration number
<dir>/<release|iter_0000123>/
    hfmeg_layout.json                        everything needed to rebuild the layout (below)
    hf/                                      config.json, tokenizer and generation config, copied verbatim
    mp_rank_TT/model.safetensors             PP = 1: one file per TP rank
    mp_rank_TT_PPP/model.safetensors         PP > 1: one file per (TP rank, PP rank)
    mp_rank_TT[_PPP]/model-experts-EEE-FFF.safetensors   saved by an expert-parallel run (below)
```

A rank file holds all of that rank's virtual chunks. Tensor names are the model
chunk's stored names (its parameter names; one per expert for the stacked MoE experts,
`parallel/stored_names.py`), which carry GLOBAL layer indices
(`layers.7.attn.qkv.weight`, `embed.weight`, `final_norm.weight`, `lm_head.weight`),
so they never collide between the virtual chunks of one rank; `hfmeg_layout.json`
says which layers each chunk holds. Every value is that TP rank's slice exactly as
`checkpoint.rules.to_local` makes it (vocabulary padded, QKV fused per KV group,
gate/up fused per rank). With tied embeddings the last stage also stores its copy
of the embedding as `lm_head.weight`, so both end stages hold it.

MoE experts are not TP-split and carry their global index (`layers.3.mlp.experts.5.fc1.weight`: one
slice of the layer's stacked expert weight, `parallel/stored_names.py`),
so a rank folder holds every expert of its layers whatever EP size saved it. An expert-
parallel run writes them where they are: `model.safetensors` from EP rank 0 (everything
but the other EP ranks' experts), and each other EP rank's experts E..F in
`model-experts-EEE-FFF.safetensors` beside it. Readers look tensors up by name across a
rank folder's weight files (`rank_files`), so a folder written at any EP size loads at any
other, and folders with one file per rank (every converter's output) are unchanged:
the format version stays 1.

`hfmeg_layout.json` (format version 1):
`format`, `format_version`, `architecture` (HF `architectures[0]`), `model_config`
(the normalised `ModelConfig` as a dict), `tp`, `pp`, `vpp`, `chunks` (model order:
index, pp_rank, virtual, layers [start, stop), pre_process, post_process),
`vocab_multiple`, `padded_vocab`, `dtype` (e.g. "bfloat16", or "mixed"),
`iteration` (null for a release).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import VOCAB_MULTIPLE, ModelConfig, check_tp
from ..errors import CheckpointError, LayoutError
from ..parallel.grid import RankGrid
from ..parallel.layout import ChunkSpec, rank_chunks, split_layers
from .atomic import write_text_atomic
from .carried import copy_carried

FORMAT = "hfmeg-mp"
FORMAT_VERSION = 1
LAYOUT_FILE = "hfmeg_layout.json"
LATEST_FILE = "latest_checkpointed_iteration.txt"
HF_DIR = "hf"
RANK_FILE = "model.safetensors"
EXPERT_FILE = "model-experts-{first:03d}-{last:03d}.safetensors"  # an EP rank's experts first..last
# safetensors metadata of the files a training save writes (model shards, optimizer shards): the global rank
# of the process that wrote the file, so that a checkpoint on a path many hosts share shows its writers
WRITER_KEY = "hfmeg_writer"
# HF side files kept beside the weights: config, generation config, tokenizer (any flavour), and a multimodal
# model's processor configs (image, video), so its export loads with its processor too.
HF_SIDE_PATTERNS = (
    "config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "*.model", "*.tiktoken", "chat_template.*", "*processor_config.json",
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def rank_files(rank_dir: Path) -> list[Path]:
    """The weight files of one rank folder: `RANK_FILE` first, then the expert files in name order."""
    return [rank_dir / RANK_FILE] + sorted(rank_dir.glob(EXPERT_FILE.split("{")[0] + "*.safetensors"))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(value: str) -> torch.dtype | None:
    """`auto` -> None (keep the source dtype of every tensor); bf16 | fp16 | fp32 -> that dtype."""
    if value == "auto":
        return None
    if value not in DTYPES:
        raise LayoutError(f"--dtype {value!r}: expected auto, bf16, fp16 or fp32")
    return DTYPES[value]


def iteration_dir_name(iteration: int | None) -> str:
    return "release" if iteration is None else f"iter_{iteration:07d}"


def is_mp_folder(path: Path) -> bool:
    """An hfmeg shard folder: a checkpoint root (with its `latest` pointer) or one iteration folder."""
    return path.is_dir() and ((path / LATEST_FILE).is_file() or (path / LAYOUT_FILE).is_file())


def hf_side_files(folder: Path) -> list[Path]:
    """The non-weight HF files of `folder` that travel verbatim with the shards."""
    found = {p for pattern in HF_SIDE_PATTERNS for p in folder.glob(pattern) if p.is_file()}
    return sorted(found)


def copy_hf_side_files(src: Path, dst: Path, *, carried: bool = True) -> None:
    """Copy the side files' bytes, not their mode: a read-only source (a Hub cache, a shared assets folder) must
    not make the run's own copies read-only; they get the umask's mode like every file hfmeg writes. `carried`:
    and the carried tensors (`carried.py`), which an MP folder keeps beside its side files and an export does not."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in hf_side_files(src):
        shutil.copyfile(path, dst / path.name)
    if carried:
        copy_carried(src, dst)


@dataclass
class MPLayout:
    architecture: str
    model_config: dict[str, Any]
    tp: int
    pp: int
    vpp: int
    chunks: list[ChunkSpec]
    vocab_multiple: int
    padded_vocab: int
    dtype: str
    iteration: int | None = None
    format_version: int = field(default=FORMAT_VERSION)

    @classmethod
    def build(cls, cfg: ModelConfig, *, tp: int, pp: int, vpp: int = 1, pp_layers: list[int] | None = None,
              vocab_multiple: int = VOCAB_MULTIPLE, dtype: str = "float32", iteration: int | None = None) -> "MPLayout":
        """Validate the layout against the model and describe it (raises UnsupportedConfigError / LayoutError)."""
        RankGrid(tp=tp, pp=pp, vpp=vpp)  # the sizes' own checks
        if vocab_multiple < 1:
            raise LayoutError(f"--vocab-multiple must be >= 1, got {vocab_multiple}")
        check_tp(cfg, tp)
        chunks = split_layers(cfg.num_layers, pp, vpp, pp_layers)
        hf = cfg.hf_config
        arch = (getattr(hf, "architectures", None) or [cfg.model_type])[0]
        return cls(arch, cfg.to_dict(), tp, pp, vpp, chunks, vocab_multiple,
                   cfg.padded_vocab(tp, vocab_multiple), dtype, iteration)

    @property
    def grid(self) -> RankGrid:
        """The ranks that hold shards: TP x PP (one data-parallel replica)."""
        return RankGrid(tp=self.tp, pp=self.pp, vpp=self.vpp)

    @property
    def pp_layers(self) -> list[int]:
        return [len(c.layers) for c in self.chunks]

    def rank_chunks(self, pp_rank: int) -> list[ChunkSpec]:
        return rank_chunks(self.chunks, pp_rank)

    def rank_dir(self, tp_rank: int, pp_rank: int) -> str:
        return f"mp_rank_{tp_rank:02d}" if self.pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"

    def check_rank_dirs(self, iter_dir: Path) -> None:
        """Refuse a rank folder this layout does not have (a save of another layout mixed in, e.g. a TP4 save's
        mp_rank_03 in a TP2 folder): a reader that went by what is there would join the wrong ranks."""
        want = {self.rank_dir(t, p) for p in range(self.pp) for t in range(self.tp)}
        extra = sorted(p.name for p in iter_dir.glob("mp_rank_*") if p.name not in want)
        if extra:
            raise CheckpointError(f"{iter_dir / extra[0]}: a rank folder the layout does not have ({LAYOUT_FILE}: "
                                  f"TP={self.tp} PP={self.pp}); the folder mixes saves of two layouts")

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "format_version": self.format_version, "architecture": self.architecture,
            "model_config": self.model_config, "tp": self.tp, "pp": self.pp, "vpp": self.vpp,
            "chunks": [
                {"index": c.index, "pp_rank": c.pp_rank, "virtual": c.virtual, "layers": [c.layers.start, c.layers.stop],
                 "pre_process": c.pre_process, "post_process": c.post_process}
                for c in self.chunks
            ],
            "vocab_multiple": self.vocab_multiple, "padded_vocab": self.padded_vocab, "dtype": self.dtype,
            "iteration": self.iteration,
        }

    def write(self, iter_dir: Path) -> None:
        (iter_dir / LAYOUT_FILE).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def read(cls, iter_dir: Path) -> "MPLayout":
        path = iter_dir / LAYOUT_FILE
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing (not an hfmeg MP checkpoint folder)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise CheckpointError(f"{path}: field format is not {FORMAT!r}")
        if d.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"{path}: field format_version {d.get('format_version')!r} is not supported "
                                  f"(this hfmeg reads version {FORMAT_VERSION})")
        try:
            chunks = [ChunkSpec(c["index"], c["pp_rank"], c["virtual"], range(*c["layers"]), c["pre_process"],
                                c["post_process"]) for c in d["chunks"]]
            layout = cls(d["architecture"], d["model_config"], d["tp"], d["pp"], d["vpp"], chunks,
                         d["vocab_multiple"], d["padded_vocab"], d["dtype"], d["iteration"], d["format_version"])
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{path}: missing or malformed field {e}") from e
        try:
            expected = split_layers(layout.model_config["num_layers"], layout.pp, layout.vpp, layout.pp_layers)
        except LayoutError as e:
            raise CheckpointError(f"{path}: field chunks is inconsistent ({e})") from e
        if expected != chunks:
            raise CheckpointError(f"{path}: field chunks does not follow the PP/VPP chunk order")
        return layout


def resolve_iteration_dir(mp_dir: str | Path, iteration: int | None = None) -> Path:
    """The iteration folder of an MP checkpoint: the one `latest_checkpointed_iteration.txt` names,
    `iteration`'s if given, or `mp_dir` itself when it is an iteration folder."""
    mp_dir = Path(mp_dir)
    if not mp_dir.is_dir():
        raise CheckpointError(f"{mp_dir}: no such folder")
    if iteration is None and (mp_dir / LAYOUT_FILE).is_file():
        return mp_dir
    if iteration is not None:
        name = iteration_dir_name(iteration)
    else:
        latest = mp_dir / LATEST_FILE
        if not latest.is_file():
            raise CheckpointError(f"{mp_dir}: not an hfmeg MP checkpoint (no {LATEST_FILE} or {LAYOUT_FILE})")
        text = latest.read_text().strip()
        if text != "release" and not text.isdigit():
            raise CheckpointError(f"{latest}: expected 'release' or an iteration number, got {text!r}")
        name = "release" if text == "release" else iteration_dir_name(int(text))
    folder = mp_dir / name
    if not folder.is_dir():
        raise CheckpointError(f"{mp_dir}: iteration folder {name} does not exist")
    return folder


def write_latest(mp_dir: Path, iteration: int | None) -> None:
    """Point `latest_checkpointed_iteration.txt` at `iteration`, atomically and durably, so after a
    power loss it names the old or the new one."""
    write_text_atomic(mp_dir / LATEST_FILE, ("release" if iteration is None else str(iteration)) + "\n")
