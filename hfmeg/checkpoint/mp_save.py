"""Runtime save of live model chunks in the MP layout, atomically (the offline converters are
`convert.py` / `reshard.py`; this module and `load.py` are the runtime side).

Collective over the default process group; every rank calls it. Protocol of `staged_save`:

1. rank 0 (re)creates `<dir>/.iter_XXXXXXX.tmp`, writes `hfmeg_layout.json` and
   copies the HF side files; barrier.
2. the caller writes into that temporary folder: `write_model_shard` (every rank
   with dp_rank 0 writes its own `mp_rank_TT[_PPP]/model.safetensors`; DP replicas
   hold identical weights; with expert parallelism the other EP ranks of DP rank 0's
   EP group add their experts beside it, `mp_layout.EXPERT_FILE`; each file records
   its writer's global rank, `mp_layout.WRITER_KEY`) and whatever else its checkpoint
   holds; barrier.
3. rank 0 renames the temporary folder to `iter_XXXXXXX` (replacing an older one
   of the same number) and only then rewrites `latest_checkpointed_iteration.txt`,
   so a crash at any point leaves the previous checkpoint as the latest one.

Each phase is local work (every rank writes its own files), and each ends in
`parallel.agree` rather than a barrier: a rank whose disk is full, or whose write
failed otherwise, reports a `CheckpointError` naming the file, and every rank raises
that same error instead of waiting in a collective for the rank that failed. A
failed save removes its temporary folder, so a full disk is not kept full by it.

What goes beside the model shards (optimizer, data, RNG) is decided by the caller:
a training checkpoint's layout is owned by `hfmeg.train.checkpointing`.
The folder must be on a file system all ranks share.
"""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..errors import CheckpointError, HfmegError, LayoutError
from ..models.decoder import ModelChunk
from ..parallel.agree import agree
from ..parallel.params_ready import wait_params_ready
from ..parallel.roles import named_roles
from ..parallel.state import ParallelState
from ..parallel.stored_names import stored_slices, stored_tensors
from .atomic import replace_dir
from .mp_layout import (EXPERT_FILE, HF_DIR, RANK_FILE, WRITER_KEY, MPLayout, copy_hf_side_files, dtype_name,
                        iteration_dir_name, write_latest)
from .rules import chunk_rules
from .st_stream import StreamingSafetensorsWriter


def _failure(e: BaseException, where: Path) -> HfmegError:
    """What a rank says when its part of a save failed: the typed error itself, or one line naming the file."""
    if isinstance(e, HfmegError):
        return e
    if isinstance(e, OSError):
        return CheckpointError(f"{e.filename or where}: cannot write the checkpoint ({e.strerror or e})")
    raise e  # a bug, not a checkpoint problem: let its traceback show


def chunks_layout(chunks: list[ModelChunk], ps: ParallelState, iteration: int | None, *,
                  pp_layers: list[int] | None = None) -> MPLayout:
    """The layout these chunks are saved under, checked against what the chunks hold.

    `pp_layers` is the run's uneven split, if any (a rank sees only its own chunks' layers);
    the vocabulary padding is the one the chunks were built with."""
    dtype = next(chunks[0].parameters()).dtype
    layout = MPLayout.build(chunks[0].cfg, tp=ps.tp, pp=ps.pp, vpp=ps.vpp, pp_layers=pp_layers,
                            vocab_multiple=chunks[0].vocab_multiple, dtype=dtype_name(dtype), iteration=iteration)
    mine = layout.rank_chunks(ps.pp_rank)
    if [list(s.layers) for s in mine] != [c.layer_ids for c in chunks]:
        raise LayoutError(f"this rank's chunks hold layers {[c.layer_ids for c in chunks]}, "
                          f"the layout implies {[list(s.layers) for s in mine]} (pass the run's pp_layers)")
    return layout


@contextmanager
def staged_save(layout: MPLayout, ps: ParallelState, mp_dir: str | Path, hf_side_dir: str | Path, *,
                check: Callable[[Path], str | None] | None = None) -> Iterator[Path]:
    """Yield the temporary iteration folder to write into; commit it on leaving (see the module docstring).

    `hf_side_dir` is the folder whose config/tokenizer files are copied verbatim (the
    source HF folder, or an MP checkpoint's `hf/`). After the block the final folder
    is `<mp_dir>/iter_<layout.iteration>` (or `release` for None). `check(folder)`: why
    the written folder is not complete (None: it is), asked by rank 0 before it commits."""
    mp_dir = Path(mp_dir)
    final = mp_dir / iteration_dir_name(layout.iteration)
    tmp = mp_dir / f".{final.name}.tmp"
    error = None
    if ps.rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            layout.write(tmp)
            copy_hf_side_files(Path(hf_side_dir), tmp / HF_DIR)
        except Exception as e:
            error = _failure(e, tmp)
    try:
        agree(error, ps.device)
        try:
            yield tmp
        except Exception as e:
            error = _failure(e, tmp)
        agree(error, ps.device)
        if ps.rank == 0:
            try:
                if check is not None and (why := check(tmp)) is not None:
                    raise CheckpointError(f"{tmp}: incomplete after every rank wrote its part ({why})")
                replace_dir(tmp, final)
                write_latest(mp_dir, layout.iteration)
            except Exception as e:
                error = _failure(e, final)
        agree(error, ps.device)
    except HfmegError:
        if ps.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_model_shard(chunks: list[ModelChunk], ps: ParallelState, layout: MPLayout, folder: Path) -> Path:
    """Write this rank's tensors into `folder/mp_rank_TT[_PPP]/`; returns that rank folder.

    One DP replica writes, so that the folder holds every tensor once (`shard_tensors`)."""
    rank_dir = folder / layout.rank_dir(ps.tp_rank, ps.pp_rank)
    rank_dir.mkdir(exist_ok=True)
    params = shard_tensors(chunks, ps, layout)
    if ps.edp_rank == 0:
        mine = chunks[0].experts
        name = RANK_FILE if ps.ep_rank == 0 else EXPERT_FILE.format(first=mine[0], last=mine[-1])
        specs = {n: (p.dtype, tuple(p.shape)) for n, p in params}
        with StreamingSafetensorsWriter(rank_dir / name, specs, {"format": "pt", WRITER_KEY: str(ps.rank)}) as writer:
            for n, p in params:
                writer.write(n, p)
    return rank_dir


def shard_tensors(chunks: list[ModelChunk], ps: ParallelState, layout: MPLayout) -> list[tuple[str, torch.Tensor]]:
    """(stored name, live tensor) of what this rank contributes to its rank folder, in file order; [] for a rank
    that contributes nothing.

    DP rank 0 gives all of its tensors; with EP > 1 the other ranks of its EP group (DP ranks 1..ep-1, expert-DP
    rank 0) hold other experts and give only those, found by their role (`write_model_shard` puts them in a file
    named by their global indices)."""
    # The overlapped optimizer's parameter all-gathers may still be in flight: without this wait
    # the shards other DP ranks own would be given as they were one step ago.
    wait_params_ready(chunks)
    if ps.edp_rank != 0:
        return []
    cfg = chunks[0].cfg
    experts = {s for c in chunks for s in _expert_names(c)}
    # remove_duplicate=False: layers sharing one Parameter (models/shared_layers.py) each give theirs.
    return [(rule.local, tensors[rule.local])
            for c, s in zip(chunks, layout.rank_chunks(ps.pp_rank))
            for tensors in [stored_tensors(c, remove_duplicate=False)]
            for rule in chunk_rules(cfg, s.layers, s.pre_process, s.post_process, c.experts)
            if ps.ep_rank == 0 or rule.local in experts]


def _expert_names(chunk: ModelChunk) -> set[str]:
    """The stored names of `chunk`'s routed-expert tensors (found by role: one per expert of a stacked weight)."""
    slices = stored_slices(chunk)
    return {s for name, _, role in named_roles(chunk) if role.expert for s in slices.get(name, [name])}
