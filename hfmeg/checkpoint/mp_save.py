"""Save live model chunks in the MP layout (training checkpoints), atomically.

Collective over the default process group; every rank calls it. Protocol:

1. rank 0 (re)creates `<dir>/.iter_XXXXXXX.tmp`, writes `hfmeg_layout.json` and
   copies the HF side files; barrier.
2. every rank waits for in-flight writes to its parameters (parallel/params_ready.py),
   every rank with dp_rank 0 writes its own `mp_rank_TT[_PPP]/model.safetensors`
   (DP replicas hold identical weights); then `on_rank_dir(rank_dir)` runs on
   every rank (e.g. the trainer's optimizer shard and data state); barrier.
3. rank 0 renames the temporary folder to `iter_XXXXXXX` (replacing an older one
   of the same number) and only then rewrites `latest_checkpointed_iteration.txt`,
   so a crash at any point leaves the previous checkpoint as the latest one.

The folder must be on a file system all ranks share.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from ..errors import LayoutError
from ..models.decoder import ModelChunk
from ..parallel.params_ready import wait_params_ready
from ..parallel.state import ParallelState
from .atomic import replace_dir
from .mp_layout import HF_DIR, RANK_FILE, MPLayout, copy_hf_side_files, dtype_name, iteration_dir_name, write_latest
from .rules import chunk_rules
from .st_stream import StreamingSafetensorsWriter


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_chunks_to_mp(
    chunks: list[ModelChunk],
    ps: ParallelState,
    mp_dir: str | Path,
    iteration: int | None,
    hf_side_dir: str | Path,
    *,
    pp_layers: list[int] | None = None,
    vocab_multiple: int = 128,
    on_rank_dir: Callable[[Path], None] | None = None,
) -> Path:
    """Write this rank's chunks into `<mp_dir>/iter_<iteration>` (or `release` for None); returns that folder.

    `hf_side_dir` is the folder whose config/tokenizer files are copied verbatim (the
    source HF folder, or an MP checkpoint's `hf/`). `pp_layers` is the run's uneven
    split, if any; `vocab_multiple` the one the chunks were built with.
    """
    mp_dir = Path(mp_dir)
    cfg = chunks[0].cfg
    dtype = next(chunks[0].parameters()).dtype
    layout = MPLayout.build(cfg, tp=ps.tp, pp=ps.pp, vpp=ps.vpp, pp_layers=pp_layers,
                            vocab_multiple=vocab_multiple, dtype=dtype_name(dtype), iteration=iteration)
    mine = layout.rank_chunks(ps.pp_rank)
    if chunks[0].padded_vocab != layout.padded_vocab:
        raise LayoutError(f"{mp_dir}: chunks have a padded vocabulary of {chunks[0].padded_vocab}, "
                          f"vocab_multiple={vocab_multiple} implies {layout.padded_vocab}")
    if [list(s.layers) for s in mine] != [c.layer_ids for c in chunks]:
        raise LayoutError(f"{mp_dir}: this rank's chunks hold layers {[c.layer_ids for c in chunks]}, "
                          f"the layout implies {[list(s.layers) for s in mine]} (pass the run's pp_layers)")
    final = mp_dir / iteration_dir_name(iteration)
    tmp = mp_dir / f".{final.name}.tmp"
    if ps.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        layout.write(tmp)
        copy_hf_side_files(Path(hf_side_dir), tmp / HF_DIR)
    _barrier()
    rank_dir = tmp / layout.rank_dir(ps.tp_rank, ps.pp_rank)
    rank_dir.mkdir(exist_ok=True)
    # The overlapped optimizer's parameter all-gathers may still be in flight: without this wait
    # the shards other DP ranks own would be written as they were one step ago.
    wait_params_ready(chunks)
    if ps.dp_rank == 0:
        params = [(rule.local, dict(c.named_parameters())[rule.local]) for c, s in zip(chunks, mine)
                  for rule in chunk_rules(cfg, s.layers, s.pre_process, s.post_process)]
        specs = {name: (p.dtype, tuple(p.shape)) for name, p in params}
        with StreamingSafetensorsWriter(rank_dir / RANK_FILE, specs, {"format": "pt"}) as writer:
            for name, p in params:
                writer.write(name, p)
    if on_rank_dir is not None:
        on_rank_dir(rank_dir)
    _barrier()
    if ps.rank == 0:
        replace_dir(tmp, final)
        write_latest(mp_dir, iteration)
    _barrier()
    return final

