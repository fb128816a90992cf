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
        rollout/                                              a GRPO run's generation batch, when the
                                                              checkpoint falls inside it (train/rollout_checkpoint.py)
    <out>/hf_source/                                         the HF side files every checkpoint copies

Everything goes into a temporary sibling first, is fsync'ed and renamed into place,
then the `latest` pointer is rewritten: a crash or power loss at any point leaves
the previous checkpoint as the newest complete one.

`RunCheckpoints` owns the whole lifecycle, so the rules live in one place:
- the HF side files (config, tokenizer) are copied once, at start, from wherever the
  model came from into `<out>/hf_source/`, which pruning never touches; every save
  copies them from there (copying them from the resumed checkpoint's `hf/` gave
  every later checkpoint an empty `hf/` once pruning removed that checkpoint);
- `--resume auto` follows `latest`; without a readable one (missing, empty, garbled, or
  naming an incomplete folder) it scans for the newest complete checkpoint, where
  complete is what the saver checks before it commits (`incomplete`), and says which
  and why. It never guesses silently and never starts from step 0 over checkpoints:
  `--resume none` on an `<out>` that holds checkpoints is refused unless
  `checkpoint.overwrite` asks for a new timeline;
- pruning keeps the newest `keep_last` by iteration NUMBER along this run's
  timeline, and never removes the checkpoint `latest` names or the one this run
  resumed from. Folders numbered above the resume point are not on this run's
  timeline. After `--resume auto` they are a run's that died before `latest` named
  them (a crash between a checkpoint's rename and its `latest` update) or damaged
  ones: this run would save over their numbers, so they are kept under names no save
  collides with (`iter_0000006.orphan`, `-2`, ...; `set_aside`, once the run has started)
  and the run says so. After an explicit `--resume PATH` to an earlier checkpoint, or
  `overwrite`, the user chose to leave them: they are replaced or pruned as oldest as
  the run saves, which the run says at start;
- temporary folders of saves and exports that died (`.iter_*.tmp`, `.hf.tmp-*`, `.adapter.tmp-*`, ...)
  are removed at start, by rank 0 holding the run's lock, which proves their
  writer gone (`remove_stale`).

Reading a checkpoint is agreed like writing it (`parallel.agree`): every rank checks
what it reads, and all raise the first rank's error as one line, before any
collective could wait for a rank that stopped.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from ..checkpoint.atomic import replace_dir
from ..checkpoint.mp_layout import (LATEST_FILE, LAYOUT_FILE, copy_hf_side_files, iteration_dir_name,
                                    resolve_iteration_dir)
from ..checkpoint.mp_save import chunks_layout, staged_save, write_model_shard
from ..errors import CheckpointError, HfmegError
from ..optim.state_io import load_optimizer_state, save_optimizer_state
from ..parallel.agree import agree
from .dataclass_io import ConfigError
from .rng import rng_state, set_rng_state

STATE_FILE = "trainer_state.json"
OPTIM_DIR = "optim"
RNG_DIR = "rng"
ROLLOUT_DIR = "rollout"
HF_SOURCE_DIR = "hf_source"
ORPHAN = "orphan"  # the suffix of a folder set aside from above an automatic resume point (`set_aside`)
# trainer_state.json: field -> type; `shared_layers` is absent from checkpoints older than layer sharing,
# `peft_base` (the base's path and sha256) from all but LoRA/DoRA runs', `dp` (the data-parallel size that
# trained to this step, for the model card) from checkpoints older than the cards' layout line.
STATE_FIELDS = {"step": int, "data": dict, "config": dict, "shared_layers": bool, "peft_base": dict, "dp": int}
STATE_OPTIONAL = {"shared_layers", "peft_base", "dp"}
# Temporary names of saves and exports (mp_save.staged_save, atomic.replace_dir / atomic_output_dir's
# `.NAME.tmp-PID` / `.NAME.old-PID` for any output: hf/, adapter/, hf_source/, pin_hf_source, write_text_atomic):
# what a run that died in the middle of writing leaves.
STALE_PATTERNS = {"checkpoints": (".iter_*.tmp", ".iter_*.old-*", f".{LATEST_FILE}.tmp"),
                  ".": (".*.tmp-*", ".*.old-*", f".{HF_SOURCE_DIR}.tmp", ".*.json.tmp")}


def _iteration(folder: Path) -> int | None:
    digits = folder.name.removeprefix("iter_")
    return int(digits) if folder.name.startswith("iter_") and digits.isdigit() else None


def _iterations(root: Path) -> dict[int, Path]:
    return {n: p for p in root.glob("iter_*") if p.is_dir() and (n := _iteration(p)) is not None}


def incomplete(folder: Path) -> str | None:
    """Why `folder` is not a complete training checkpoint, or None. The saver checks it before it commits a
    checkpoint, and `--resume auto` scans with it, so what one writes the other accepts."""
    for name in (LAYOUT_FILE, STATE_FILE):
        if not (folder / name).is_file():
            return f"no {name}"
    if not any((folder / OPTIM_DIR).glob("optim_*.safetensors")):
        return f"no optimizer shards in {OPTIM_DIR}/"
    return None


@dataclass
class Resume:
    """Where a run starts: `folder` (None: step 0), and what the run should say about it."""

    folder: Path | None
    notes: list[str]
    newer: dict[int, Path]  # `--resume auto`: folders numbered above `folder`, to be set aside (not this timeline's)


def find_resume(root: Path, resume: str, *, overwrite: bool = False) -> Resume:
    """The iteration folder to resume from: `none`, `auto` (see the module docstring) or a path."""
    iters = _iterations(root) if root.is_dir() else {}
    if resume == "none":
        if iters and not overwrite:
            raise CheckpointError(f"{root}: holds checkpoints ({_names(iters)}) and checkpoint.resume is none, which "
                                  "would start a new timeline over them: pass --resume auto to continue, --overwrite "
                                  "to start over (they are pruned as the new run saves), or another --out")
        notes = [f"checkpoint.overwrite: starting over; the checkpoints in {root} are pruned as this run saves"] \
            if iters else []
        return Resume(None, notes, {})
    if resume != "auto":
        folder = Path(resume)
        if not (folder / STATE_FILE).is_file():
            raise CheckpointError(f"{folder}: not a complete hfmeg training checkpoint (no {STATE_FILE})")
        at = _iteration(folder)
        if at is None:  # a folder set aside (`iter_0000006.orphan`): its step is in its state
            try:
                at = int(json.loads((folder / STATE_FILE).read_text())["step"])
            except (OSError, ValueError, KeyError, TypeError):
                at = 0
        newer = {n: p for n, p in iters.items() if folder.parent.resolve() == root.resolve() and n > at}
        notes = [f"checkpoint.resume: {_names(newer)} in {root} are newer than {folder.name} and belong to the "
                 "timeline this run leaves; they are replaced or pruned as it saves"] if newer else []
        return Resume(folder, notes, {})
    if not iters and not (root / LATEST_FILE).exists():
        return Resume(None, [], {})  # a first run
    why = None
    try:
        folder = resolve_iteration_dir(root)
        if (reason := incomplete(folder)) is not None:
            why = f"{root / LATEST_FILE} names {folder.name}, which is incomplete ({reason})"
    except CheckpointError as e:  # missing, empty or garbled, or naming a folder that is gone
        why = str(e) if (root / LATEST_FILE).exists() else f"{root}: no {LATEST_FILE}"
    if why is None:
        return Resume(folder, [], {n: p for n, p in iters.items() if n > _iteration(folder)})
    complete = {n: p for n, p in iters.items() if incomplete(p) is None}
    if not complete:
        raise CheckpointError(f"{why}, and no folder in {root} is a complete checkpoint; pass --resume PATH, or "
                              "--resume none --overwrite to start over")
    newest = max(complete)
    return Resume(complete[newest], [f"{why}: resuming from {complete[newest].name}, the newest complete checkpoint"],
                  {n: p for n, p in iters.items() if n > newest})


def _names(iters: dict[int, Path]) -> str:
    return ", ".join(iters[n].name for n in sorted(iters))


class RunCheckpoints:
    """The checkpoints of one run's `<out>`: where to resume from, saving, pruning.

    Collective: every rank builds it, and an error (a refused resume) is raised on all of them."""

    def __init__(self, out: Path, *, keep_last: int, resume: str, overwrite: bool = False, device="cpu"):
        if keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last: must be >= 1 (got {keep_last}); it is how many checkpoints "
                              "to keep, and 0 would delete every one")
        self.out = out
        self.root = out / "checkpoints"
        self.hf_source = out / HF_SOURCE_DIR
        self.keep_last = keep_last
        found, error = None, None
        try:
            found = find_resume(self.root, resume, overwrite=overwrite)
        except HfmegError as e:
            error = e
        agree(error, device)
        self.resume_dir, self.notes, self.newer = found.folder, found.notes, found.newer

    def set_aside(self) -> list[str]:
        """Rank 0, once the run has started: rename the folders above an automatic resume point to names no
        save collides with (see the module docstring); one line each saying so."""
        lines = []
        for n in sorted(self.newer):
            folder = self.newer[n]
            aside = folder.with_name(f"{folder.name}.{ORPHAN}")
            k = 1
            while aside.exists():
                k += 1
                aside = folder.with_name(f"{folder.name}.{ORPHAN}-{k}")
            folder.rename(aside)
            what = "a complete checkpoint" if incomplete(aside) is None else f"incomplete ({incomplete(aside)})"
            lines.append(f"checkpoint.resume: {folder.name} in {self.root} is newer than "
                         f"{self.resume_dir.name if self.resume_dir else 'step 0'}, where this run resumes, and not "
                         f"on its timeline ({what}, left by a run that died before {LATEST_FILE} named it): kept "
                         f"as {aside.name}, which no save of this run overwrites; resume from it with "
                         f"--resume {aside}")
        self.newer = {}
        return lines

    def remove_stale(self) -> list[Path]:
        """Rank 0, holding the run's lock: remove temporary folders and files of saves and exports that died."""
        removed = []
        for sub, patterns in STALE_PATTERNS.items():
            for pattern in patterns:
                for path in sorted((self.out / sub).glob(pattern)):
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
                    removed.append(path)
        return removed

    def pin_hf_source(self, src: Path) -> None:
        """Rank 0, at start: copy the HF side files of `src` (the model's folder) into `<out>/hf_source/`."""
        if not (src / "config.json").is_file():
            raise CheckpointError(f"{src}: no config.json (the HF side files every checkpoint must carry)")
        tmp = self.hf_source.parent / f".{HF_SOURCE_DIR}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        copy_hf_side_files(src, tmp)
        replace_dir(tmp, self.hf_source)

    def save(self, step: int, chunks, ps, opt, trainer_state: dict[str, Any], *,
             pp_layers: list[int] | None, write_model: Callable = write_model_shard,
             write_data: Callable[[Path], None] | None = None) -> Path:
        """Collective: every rank calls it. Returns the checkpoint's iteration folder.

        `write_model(chunks, ps, layout, folder)` writes the model's part (a LoRA run writes
        its adapter shards instead: the model part's `write_model`, `parts/`); `write_data(folder)`, on
        every rank, what the data keeps beside its state (a GRPO run's generation batch, `ROLLOUT_DIR`)."""
        # Checked on every rank (the folder is shared), so that all stop here rather than some in a barrier.
        if not (self.hf_source / "config.json").is_file():
            raise CheckpointError(f"{self.hf_source}: no config.json; it was copied at the start of the run and "
                                  "must stay while the run lasts")
        layout = chunks_layout(chunks, ps, step, pp_layers=pp_layers)
        with staged_save(layout, ps, self.root, self.hf_source, check=incomplete) as folder:
            write_model(chunks, ps, layout, folder)
            save_optimizer_state(opt, folder / OPTIM_DIR)
            (folder / RNG_DIR).mkdir(exist_ok=True)
            _rng_file(folder).write_text(json.dumps(rng_state(ps.device)))
            if write_data is not None:
                write_data(folder)
            if ps.rank == 0:
                (folder / STATE_FILE).write_text(json.dumps({**trainer_state, "step": step}, indent=2))
        if ps.rank == 0:
            self.prune(step)
        return self.root / iteration_dir_name(step)

    def prune(self, current: int) -> list[Path]:
        """Remove what `keep_last` does not keep (see the module docstring); returns the removed folders."""
        iters = _iterations(self.root)
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


def rng_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def _rng_file(folder: Path) -> Path:
    return folder / RNG_DIR / rng_file_name(dist.get_rank())


def rng_not_restored(folder: Path, world: int) -> str | None:
    """Why a resume from `folder` at `world` ranks does not restore the random state the uninterrupted run
    would have (None: it does): the checkpoint holds one state per rank of the world that saved it, and
    a reshard to another pipeline split or a resume at another world size has none for this one."""
    saved = len(list((folder / RNG_DIR).glob("rank_*.json")))
    if saved == world:
        return None
    if saved == 0:
        return f"{folder / RNG_DIR}: absent (resharded to another pipeline split, whose stages draw for other layers)"
    return f"{folder / RNG_DIR}: holds {saved} ranks' random states, this run has {world} ranks (another DP size)"


def check_trainer_state(state: Any, path: Path) -> dict[str, Any]:
    """`state` if it has the fields `STATE_FIELDS` names, of their types; else one line naming the field."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(state).__name__}")
    for key, typ in STATE_FIELDS.items():
        if key not in state:
            if key in STATE_OPTIONAL:
                continue
            raise CheckpointError(f"{path}: field {key} is missing; resume from an earlier checkpoint with "
                                  "--resume PATH")
        # bool is an int in Python: a step of `true` is refused too.
        if not isinstance(state[key], typ) or (typ is int and isinstance(state[key], bool)):
            raise CheckpointError(f"{path}: field {key} should be {typ.__name__}, got {state[key]!r:.60}")
    if state["step"] < 0:
        raise CheckpointError(f"{path}: field step is negative ({state['step']})")
    extra = sorted(set(state) - set(STATE_FIELDS))
    if extra:
        raise CheckpointError(f"{path}: unknown field {extra[0]} (written by another program or version?)")
    return state


def read_trainer_state(folder: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint (step, data position, config, layer-sharing phase), checked."""
    path = folder / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {STATE_FILE}; the checkpoint is incomplete")
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e}); resume from an earlier checkpoint with --resume PATH") from e
    return check_trainer_state(state, path)


def load_trainer_state(folder: Path, opt, source_name: Callable[[str], str] | None = None) -> dict[str, Any]:
    """Collective: restore optimizer shards and this rank's RNG; return the trainer state (step, data, ...).

    `source_name`: which saved tensor's state each parameter takes (`load_optimizer_state`).
    What every rank reads is checked and agreed on before the optimizer's collectives run."""
    rng, state, error = None, None, None
    try:
        state = read_trainer_state(folder)
        path = _rng_file(folder)
        if path.is_file():  # absent when resuming with a different world size: seeds then differ per rank
            try:
                rng = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{path}: unreadable ({e})") from e
    except HfmegError as e:
        error = e
    agree(error, opt.ps.device)
    load_optimizer_state(opt, folder / OPTIM_DIR, source_name)
    if rng is not None:
        set_rng_state(rng, opt.ps.device)
    return state
