"""Training checkpoints: model shards, optimizer shards, data, LR and RNG state.

A checkpoint is an MP shard folder (`hfmeg.checkpoint.mp_save`), so the converters
and `verify_parity.py` read it directly:

    <out>/checkpoints/latest_checkpointed_iteration.txt     written last
    <out>/checkpoints/iter_0000020/
        hfmeg_layout.json, hf/                              model layout + HF side files
        mp_rank_TT[_PPP]/model.safetensors                   model shards (DP rank 0 writes)
        optim/optim_ppPPP_tpTT_dpDDD.safetensors             sharded fp32 master + Adam moments
        rng/rank_RRRRR.json                                   every rank's RNG state
        trainer_state.json                                    step, data position, config

Everything goes into a temporary sibling first and is renamed into place, then the
`latest` pointer is rewritten: a crash at any point leaves the previous checkpoint
as the newest complete one. Only the last `keep_last` checkpoints are kept.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..checkpoint.mp_layout import LATEST_FILE, resolve_iteration_dir
from ..checkpoint.mp_save import save_chunks_to_mp
from ..errors import CheckpointError
from ..optim.state_io import load_optimizer_state, save_optimizer_state
from .rng import rng_state, set_rng_state

STATE_FILE = "trainer_state.json"


def save_checkpoint(root: Path, step: int, chunks, ps, opt, hf_side_dir: Path, trainer_state: dict[str, Any], *,
                    pp_layers: list[int] | None, vocab_multiple: int, keep_last: int) -> Path:
    """Collective: every rank calls it. Returns the checkpoint's iteration folder."""

    def extras(rank_dir: Path) -> None:
        iter_tmp = rank_dir.parent
        save_optimizer_state(opt, iter_tmp / "optim")
        (iter_tmp / "rng").mkdir(exist_ok=True)
        (iter_tmp / "rng" / f"rank_{dist.get_rank():05d}.json").write_text(json.dumps(rng_state()))
        if dist.get_rank() == 0:
            (iter_tmp / STATE_FILE).write_text(json.dumps({**trainer_state, "step": step}, indent=2))

    folder = save_chunks_to_mp(chunks, ps, root, step, hf_side_dir, pp_layers=pp_layers,
                               vocab_multiple=vocab_multiple, on_rank_dir=extras)
    if dist.get_rank() == 0:
        _prune(root, keep_last)
    return folder


def _prune(root: Path, keep_last: int) -> None:
    iters = sorted(p for p in root.glob("iter_*") if p.is_dir() and p.name[5:].isdigit())
    for old in iters[: max(0, len(iters) - keep_last)]:
        shutil.rmtree(old, ignore_errors=True)


def find_resume(root: Path, resume: str) -> Path | None:
    """The iteration folder to resume from: `none`, `auto` (newest complete, if any) or a path."""
    if resume == "none":
        return None
    if resume == "auto":
        return resolve_iteration_dir(root) if (root / LATEST_FILE).is_file() else None
    folder = Path(resume)
    if not (folder / STATE_FILE).is_file():
        raise CheckpointError(f"{folder}: not a complete hfmeg training checkpoint (no {STATE_FILE})")
    return folder


def load_trainer_state(folder: Path, opt) -> dict[str, Any]:
    """Restore optimizer shards and this rank's RNG; return the trainer state (step, data, ...)."""
    path = folder / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {STATE_FILE}; the checkpoint is incomplete")
    state = json.loads(path.read_text())
    load_optimizer_state(opt, folder / "optim")
    rng = folder / "rng" / f"rank_{dist.get_rank():05d}.json"
    if rng.is_file():  # absent when resuming with a different world size: seeds then differ per rank
        set_rng_state(json.loads(rng.read_text()))
    return state
