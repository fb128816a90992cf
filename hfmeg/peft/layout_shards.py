"""Full PEFT tensors cut into every rank's adapter tensors of a layout, in one process.

`convert_hf_to_mp.py --adapter` (a PEFT folder onto freshly converted shards) and
`reshard_mp.py` (a LoRA training checkpoint at another TP/PP) write the adapter shards
of ranks that do not exist as processes. They use the code the trainer uses, so the
names, splits and files are the runtime's by construction: for each rank, its chunks
are built on the meta device for a stand-in of its TP coordinates, get their adapters
(`attach`); only the adapter tensors are then materialised (the base stays on meta:
no base weight is read or held) and `initialise` slices the full tensors into them,
as `peft.init_from` does. The same chunks carry any other tensor shaped like the
adapters (the optimizer's fp32 masters and moments when resharding).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from ..checkpoint.convert import load_model_config
from ..checkpoint.placement import as_saved
from ..checkpoint.hub_source import resolve_hf_source
from ..checkpoint.mp_layout import HF_DIR, MPLayout
from ..errors import CheckpointError
from ..models.decoder import ModelChunk
from ..parallel.grid import RankPlace
from ..parallel.stored_names import stored_tensors
from .adapter_files import base_fingerprint, meta_rank_chunks, write_adapter_shard
from .adapters import adapter_tensors, initialise
from .config import PeftConfig
from .export import write_info


def rank_adapters(model_cfg, layout: MPLayout, cfg: PeftConfig,
                  tensors: dict[str, torch.Tensor]) -> Iterator[tuple[RankPlace, list[ModelChunk]]]:
    """For every rank (TP fastest) of `layout`: (its place in the grid, its chunks holding its slices of
    `tensors`, PEFT key -> full tensor, in their dtype). Refuses tensors that no rank takes."""
    used: set[str] = set()
    for ps, chunks in meta_rank_chunks(model_cfg, layout, cfg):
        for chunk in chunks:
            dtype = next(iter(tensors.values())).dtype
            for module in chunk.modules():  # the trainable (adapter) parameters only; the base stays on meta
                for name, meta in list(module.named_parameters(recurse=False)):
                    if meta.requires_grad:
                        module._parameters[name] = nn.Parameter(torch.empty(meta.shape, dtype=dtype))
            views = stored_tensors(chunk)
            for a in adapter_tensors(chunk):
                if a.hf not in tensors:
                    raise CheckpointError(f"no tensor {a.hf}: the adapter does not cover every targeted "
                                          "projection of this model")
                need = a.full_shape(views[a.local].shape, layout.tp)
                if tuple(tensors[a.hf].shape) != need:
                    raise CheckpointError(f"tensor {a.hf} has shape {list(tensors[a.hf].shape)}, this model "
                                          f"needs {list(need)}")
                used.add(a.hf)
            initialise(chunk, cfg, seed=0, hf_tensors=tensors)
        yield ps, chunks
    unused = sorted(set(tensors) - used)
    if unused:
        raise CheckpointError(f"adapter tensor {unused[0]} (and {len(unused) - 1} more) adapts nothing in this "
                              "model (another model's adapter?)")


def local_tensors(chunks: list[ModelChunk]) -> dict[str, torch.Tensor]:
    """The chunks' adapter tensors under their parameter names, in the order `adapter_tensors` gives."""
    out = {}
    for chunk in chunks:
        params = stored_tensors(chunk)
        out.update({a.local: params[a.local].detach() for a in adapter_tensors(chunk)})
    return out


def write_layout_shards(iter_dir: Path, model_cfg, layout: MPLayout, cfg: PeftConfig,
                        tensors: dict[str, torch.Tensor]) -> None:
    """Every rank's `adapter.safetensors` of `layout` under `iter_dir`, from the full PEFT `tensors`."""
    for ps, chunks in rank_adapters(model_cfg, layout, cfg, tensors):
        write_adapter_shard(chunks, ps, Path(iter_dir) / layout.rank_dir(ps.tp_rank, ps.pp_rank))


def import_adapter(iter_dir: Path, cfg: PeftConfig, tensors: dict[str, torch.Tensor], base: str) -> None:
    """`convert_hf_to_mp.py --adapter`: a PEFT adapter (`cfg`, `tensors` as `read_peft_folder` gives them, the
    reading `peft.init_from` does) onto the freshly written shards in `iter_dir`, with `adapter.json` naming
    `base` (the converted HF folder or Hub id) and the hash of its weights, as a LoRA run's checkpoint does;
    `convert_mp_to_hf.py` then exports the adapter (and `--merge`s it) from the shards."""
    iter_dir = Path(iter_dir)
    layout = MPLayout.read(iter_dir)
    model_cfg = as_saved(load_model_config(iter_dir / HF_DIR), layout.model_config)
    write_layout_shards(iter_dir, model_cfg, layout, cfg, tensors)
    write_info(iter_dir, cfg, {"path": base, "sha256": base_fingerprint(resolve_hf_source(base))})
