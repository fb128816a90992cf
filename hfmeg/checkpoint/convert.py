"""HF <-> Megatron-style TP x PP shards, streaming.

`hf_to_mp` and `reshard_mp` (reshard.py) share `write_mp_checkpoint`: for each
pipeline rank it opens that rank's TP files (streaming safetensors writers whose
headers are computed up front from the shapes), then walks the rank's tensor
rules in file order; each rule's source tensors are read once (`source.get`, lazy
per tensor), cut into the TP slices by `rules.to_local`, and each slice is written
to its rank file by a write-behind thread (so reading the next tensor overlaps
writing this one; one slice queued at most). The largest thing in memory is
therefore one full tensor plus two of its slices (for LLaMA-7B in bf16 at TP4:
the 0.26 GB embedding + 2 x 0.07 GB), never a rank file or the model.

The source is anything with `folder`, `shape(name)`, `dtype(name)` and `get(name)`
by HF name: an `HFCheckpoint` for conversion, an `MPCheckpoint` (which merges
slices with `rules.to_hf` on demand) for resharding. `mp_to_hf` writes HF shards
from an `MPCheckpoint` (hf_writer.py).

Everything that can be checked before writing is checked first (config, layout,
every tensor's presence and shape), and all output goes through
`atomic_output_dir`, so bad input leaves no output folder behind.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable

import torch

from ..config import VOCAB_MULTIPLE, ModelConfig, load_hf_config
from ..families import FAMILIES, WRAPPERS, model_config_from_hf
from ..errors import CheckpointError, UnsupportedConfigError
from .atomic import atomic_output_dir
from .hf_reader import HFCheckpoint
from .hf_writer import parse_size, write_hf_folder
from .hub_source import resolve_hf_source
from .mp_layout import (HF_DIR, RANK_FILE, MPLayout, copy_hf_side_files, dtype_name, iteration_dir_name, parse_dtype,
                        write_latest)
from .mp_reader import MPCheckpoint, ShardView, local_shape, rank_rules
from .placement import as_stored, check_placed
from .rules import expected_hf_shape, rule_tensors, to_local
from .st_stream import StreamingSafetensorsWriter, WriteBehind

SUPPORTED_ARCHITECTURES = tuple(f.architecture for f in FAMILIES) + tuple(w.architecture for w in WRAPPERS)


def load_model_config(folder: Path) -> ModelConfig:
    """The normalised config of an HF folder (a multimodal wrapper's language model); refuses architectures other
    than the causal-LM heads and the wrappers'."""
    hf = load_hf_config(folder)
    with config_errors_name(folder):
        cfg = model_config_from_hf(hf)
    for arch in getattr(hf, "architectures", None) or []:
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedConfigError(
                f"{folder / 'config.json'} field architectures: {arch!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
    return cfg


@contextmanager
def config_errors_name(folder: Path):
    """Prefix the folder to 'config.json field ...' errors, so the message names the file."""
    try:
        yield
    except UnsupportedConfigError as e:
        if str(e).startswith("config.json"):
            raise UnsupportedConfigError(f"{folder / str(e)}") from e
        raise


def check_source(source, cfg: ModelConfig, layout: MPLayout) -> None:
    """Every tensor the layout needs exists in `source` with the shape config.json implies."""
    for p in range(layout.pp):
        for rule in rank_rules(cfg, layout, p):
            for j, name in enumerate(rule.hf):
                got, want = tuple(source.shape(name)), expected_hf_shape(rule, j, cfg)
                if got != want:
                    raise CheckpointError(
                        f"{source.folder}: tensor {name} has shape {list(got)}, config.json implies {list(want)}"
                    )


def write_mp_shards(source, cfg: ModelConfig, layout: MPLayout, iter_dir: Path, dtype: torch.dtype | None) -> str:
    """Write every rank file of `layout` into `iter_dir`; returns the dtype name for the metadata."""
    tp, mult = layout.tp, layout.vocab_multiple
    written: set[torch.dtype] = set()
    for p in range(layout.pp):
        rules = rank_rules(cfg, layout, p)
        targets = [dtype or source.dtype(rule.hf[0]) for rule in rules]
        written.update(targets)
        specs = [{} for _ in range(tp)]
        for rule, target in zip(rules, targets):
            shapes = [tuple(source.shape(n)) for n in rule.hf]
            for t in range(tp):
                specs[t][rule.local] = (target, local_shape(rule, cfg, shapes, tp, t, mult))
        with ExitStack() as stack:
            writers = []
            for t in range(tp):
                rank_dir = iter_dir / layout.rank_dir(t, p)
                rank_dir.mkdir()
                writers.append(stack.enter_context(
                    StreamingSafetensorsWriter(rank_dir / RANK_FILE, specs[t], {"format": "pt"})))
            with WriteBehind(depth=1) as behind:
                for (rule, full), target in zip(rule_tensors(source, rules), targets):
                    for t, writer in enumerate(writers):
                        behind.write(writer, rule.local, to_local(rule, full, cfg, tp, t, mult).to(target))
    return dtype_name(written.pop()) if len(written) == 1 else "mixed"


def write_mp_checkpoint(source, cfg: ModelConfig, layout: MPLayout, hf_side_dir: Path, out: str | Path, *,
                        dtype: torch.dtype | None, overwrite: bool, inputs: tuple[Path, ...],
                        extra: Callable[[Path], None] | None = None) -> Path:
    """Check `source` against `layout`, then write a complete checkpoint to `out`, atomically.

    It is a release unless `layout.iteration` is set; `extra(iteration_folder)` adds files
    (a training checkpoint's optimizer and trainer state) inside the same atomic write."""
    check_source(source, cfg, layout)
    with atomic_output_dir(out, overwrite=overwrite, inputs=inputs) as tmp:
        iter_dir = tmp / iteration_dir_name(layout.iteration)
        iter_dir.mkdir()
        layout.dtype = write_mp_shards(source, cfg, layout, iter_dir, dtype)
        layout.write(iter_dir)
        copy_hf_side_files(hf_side_dir, iter_dir / HF_DIR)
        if extra is not None:
            extra(iter_dir)
        write_latest(tmp, layout.iteration)
    return Path(out)


def hf_to_mp(hf: str | Path, out: str | Path, *, tp: int, pp: int, vpp: int = 1, pp_layers: list[int] | None = None,
             dtype: str = "auto", vocab_multiple: int = VOCAB_MULTIPLE, overwrite: bool = False,
             extra: Callable[[Path], None] | None = None) -> Path:
    """Convert an HF folder (or Hub id) into the MP shard layout at `out` (`extra`: as `write_mp_checkpoint`)."""
    folder = resolve_hf_source(hf)
    target = parse_dtype(dtype)
    source = HFCheckpoint(folder)
    cfg = as_stored(load_model_config(folder), source)
    check_placed(source, cfg)
    with config_errors_name(folder):
        layout = MPLayout.build(cfg, tp=tp, pp=pp, vpp=vpp, pp_layers=pp_layers, vocab_multiple=vocab_multiple)
    return write_mp_checkpoint(source, cfg, layout, folder, out, dtype=target, overwrite=overwrite,
                               inputs=(folder,), extra=extra)


def mp_to_hf(mp: str | Path, out: str | Path, *, dtype: str = "auto", max_shard_size: str | int = "5GB",
             overwrite: bool = False, iteration: int | None = None) -> Path:
    """Convert an MP checkpoint back into an HF folder that `from_pretrained` loads."""
    return shards_to_hf(MPCheckpoint(mp, iteration), out, dtype=dtype, max_shard_size=max_shard_size,
                        overwrite=overwrite, inputs=(Path(mp),))


def shards_to_hf(source: ShardView, out: str | Path, *, dtype: str = "auto", max_shard_size: str | int = "5GB",
                 overwrite: bool = False, inputs: tuple[Path, ...] = ()) -> Path:
    """Write the HF folder `out` from shards (an MP checkpoint's, or a run's live ones, `live_shards.py`)."""
    target = parse_dtype(dtype)
    max_bytes = parse_size(max_shard_size)
    with atomic_output_dir(out, overwrite=overwrite, inputs=inputs) as tmp:
        write_hf_folder(source, tmp, target, max_bytes)
    return Path(out)
