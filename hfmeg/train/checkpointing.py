"""Training checkpoints: the one owner of their layout (model shards, optimizer, data, RNG, step).

A checkpoint is an MP shard folder, so the converters and `verify_parity.py` read it
directly. This module asks each stateful part for its state and decides where it
goes; `hfmeg.checkpoint.mp_save` only stages the folder atomically and writes the
model tensors into it:

    <out>/checkpoints/latest_checkpointed_iteration.txt     written last
    <out>/checkpoints/iter_0000020/
        hfmeg_layout.json, hf/                              model layout + HF side files
        mp_rank_TT[_PPP]/model.safetensors                   model shards (DP rank 0 writes)
        optim/optim_ppPPP_tpTT_dpDDD.safetensors             sharded fp32 master + Adam moments
        rng/rank_RRRRR.json                                   every rank's RNG state
        trainer_state.json                                    step, data position, config
    <out>/hf_source/                                         the HF side files every checkpoint copies

Everything goes into a temporary sibling first, is fsync'ed and renamed into place,
then the `latest` pointer is rewritten: a crash or power loss at any point leaves
the previous checkpoint as the newest complete one.

`RunCheckpoints` owns the whole lifecycle, so the rules live in one place:
- the HF side files (config, tokenizer) are copied once, at start, from wherever the
  model came from into `<out>/hf_source/`, which pruning never touches; every save
  copies them from there (copying them from the resumed checkpoint's `hf/` gave
  every later checkpoint an empty `hf/` once pruning removed that checkpoint);
- pruning keeps the newest `keep_last` by iteration NUMBER along this run's
  timeline, and never removes the checkpoint `latest` names or the one this run
  resumed from. Checkpoints numbered above the one just written were left by an
  abandoned run (this one resumed from an earlier checkpoint) and count as oldest.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from ..checkpoint.atomic import replace_dir
from ..checkpoint.mp_layout import LATEST_FILE, copy_hf_side_files, iteration_dir_name, resolve_iteration_dir
from ..checkpoint.mp_save import chunks_layout, staged_save, write_model_shard
from ..errors import CheckpointError
from ..optim.state_io import load_optimizer_state, save_optimizer_state
from .dataclass_io import ConfigError
from .rng import rng_state, set_rng_state

STATE_FILE = "trainer_state.json"
OPTIM_DIR = "optim"
RNG_DIR = "rng"
HF_SOURCE_DIR = "hf_source"


def _iteration(folder: Path) -> int | None:
    digits = folder.name.removeprefix("iter_")
    return int(digits) if folder.name.startswith("iter_") and digits.isdigit() else None


class RunCheckpoints:
    """The checkpoints of one run's `<out>`: where to resume from, saving, pruning."""

    def __init__(self, out: Path, *, keep_last: int, resume: str):
        if keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last: must be >= 1 (got {keep_last}); it is how many checkpoints "
                              "to keep, and 0 would delete every one")
        self.root = out / "checkpoints"
        self.hf_source = out / HF_SOURCE_DIR
        self.keep_last = keep_last
        self.resume_dir = find_resume(self.root, resume)

    def pin_hf_source(self, src: Path) -> None:
        """Rank 0, at start: copy the HF side files of `src` (the model's folder) into `<out>/hf_source/`."""
        if not (src / "config.json").is_file():
            raise CheckpointError(f"{src}: no config.json (the HF side files every checkpoint must carry)")
        tmp = self.hf_source.parent / f".{HF_SOURCE_DIR}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        copy_hf_side_files(src, tmp)
        replace_dir(tmp, self.hf_source)

    def save(self, step: int, chunks, ps, opt, trainer_state: dict[str, Any], *,
             pp_layers: list[int] | None, write_model: Callable = write_model_shard) -> Path:
        """Collective: every rank calls it. Returns the checkpoint's iteration folder.

        `write_model(chunks, ps, layout, folder)` writes the model's part (a LoRA run writes
        its adapter shards instead, `peft_run.py`)."""
        # Checked on every rank (the folder is shared), so that all stop here rather than some in a barrier.
        if not (self.hf_source / "config.json").is_file():
            raise CheckpointError(f"{self.hf_source}: no config.json; it was copied at the start of the run and "
                                  "must stay while the run lasts")
        layout = chunks_layout(chunks, ps, step, pp_layers=pp_layers)
        with staged_save(layout, ps, self.root, self.hf_source) as folder:
            write_model(chunks, ps, layout, folder)
            save_optimizer_state(opt, folder / OPTIM_DIR)
            (folder / RNG_DIR).mkdir(exist_ok=True)
            _rng_file(folder).write_text(json.dumps(rng_state(ps.device)))
            if ps.rank == 0:
                (folder / STATE_FILE).write_text(json.dumps({**trainer_state, "step": step}, indent=2))
        if ps.rank == 0:
            self.prune(step)
        return self.root / iteration_dir_name(step)

    def prune(self, current: int) -> list[Path]:
        """Remove what `keep_last` does not keep (see the module docstring); returns the removed folders."""
        iters = {n: p for p in self.root.glob("iter_*") if p.is_dir() and (n := _iteration(p)) is not None}
        newest_first = sorted(iters, key=lambda n: (n <= current, n), reverse=True)
        protected = {resolve_iteration_dir(self.root).resolve()}
        if self.resume_dir is not None:
            protected.add(self.resume_dir.resolve())
        removed = []
        for n in newest_first[self.keep_last:]:
            if iters[n].resolve() not in protected:
                shutil.rmtree(iters[n], ignore_errors=True)
                removed.append(iters[n])
        return removed


def _rng_file(folder: Path) -> Path:
    return folder / RNG_DIR / f"rank_{dist.get_rank():05d}.json"


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


def read_trainer_state(folder: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint (step, data position, config, layer-sharing phase), checked."""
    path = folder / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {STATE_FILE}; the checkpoint is incomplete")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e}); resume from an earlier checkpoint with --resume PATH") from e


def load_trainer_state(folder: Path, opt, source_name: Callable[[str], str] | None = None) -> dict[str, Any]:
    """Restore optimizer shards and this rank's RNG; return the trainer state (step, data, ...).

    `source_name`: which saved tensor's state each parameter takes (`load_optimizer_state`)."""
    state = read_trainer_state(folder)
    load_optimizer_state(opt, folder / OPTIM_DIR, source_name)
    rng = _rng_file(folder)
    if rng.is_file():  # absent when resuming with a different world size: seeds then differ per rank
        set_rng_state(json.loads(rng.read_text()), opt.ps.device)
    return state
