"""Reshard a training checkpoint whole, so `--resume` continues the run at another TP/PP/VPP.

`hfmeg reshard` (and `tools/reshard_mp.py`) call this, through the checkpoint's model part, for a folder with
`trainer_state.json` (`reshard_full`):
- the model weights are resharded as `checkpoint/reshard.py` does;
- the optimizer's fp32 master weights and Adam moments are each a tensor shaped like
  its parameter, so they go through the same key table: `OptimizerStateView` serves
  one of them as if it were the model (the old ranks' DP pieces joined by parameter
  name), `write_mp_shards` cuts it into the new layout, and each new rank's three
  tensors are packed into one optimizer shard with DP=1 (the loader re-partitions by
  name over any DP size, `optim/state_io.py`); step, skipped steps and loss scale are
  carried in its metadata. A checkpoint saved with shared layers (`train.shared_layers_until`)
  holds optimizer state under layer 0's names only; every layer is written with it, which
  the resumed run reads whichever phase it is in (models/shared_layers.py);
- `trainer_state.json` (step, data position, config) is copied verbatim: which rows
  form global batch k does not depend on the layout; so is a GRPO checkpoint's `rollout/` (its held generation
  batch, keyed by completion and position: train/rollout_checkpoint.py).
A LoRA/DoRA checkpoint (adapter shards, `adapter.json`) moves only its adapters and their optimizer
state (`reshard_adapters`); the base it references is not in it. Which of the two a checkpoint takes is its
model part's to say (`parts/__init__.py` `reshard_training_checkpoint`).
Per-rank RNG states (what LoRA dropout draws from) are carried where that keeps the resume exact
(`_carry_rng`): the TP ranks of one pipeline stage and DP/CP index draw the same masks (`peft/adapters.py`
`InputDropout`) from one state, so at another TP size each new rank takes its stage's state, for the same
DP x CP size. At another pipeline split each stage would draw for other layers: no state is written, and the
resumed run says in one line that its dropout masks differ from the uninterrupted run's.
Memory: one old pipeline stage's state of one kind, plus one new rank's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from ..checkpoint.atomic import atomic_output_dir, save_tensors
from ..checkpoint.convert import config_errors_name, load_model_config, write_mp_checkpoint, write_mp_shards
from ..checkpoint.placement import as_saved
from ..checkpoint.mp_layout import (
    HF_DIR,
    RANK_FILE,
    MPLayout,
    copy_hf_side_files,
    iteration_dir_name,
    parse_dtype,
    resolve_iteration_dir,
    write_latest,
)
from ..checkpoint.mp_reader import MPCheckpoint, rank_rules
from ..checkpoint.st_stream import read_tensor
from ..errors import CheckpointError
from ..models.shared_layers import shared_name
from ..optim.state_io import STATE, read_meta
from ..peft.adapter_files import assemble, check_adapter_shards
from ..peft.export import INFO_FILE, read_info
from ..peft.layout_shards import local_tensors, rank_adapters, write_layout_shards
from .checkpointing import OPTIM_DIR, RNG_DIR, ROLLOUT_DIR, STATE_FILE, read_trainer_state, rng_file_name


def _stage_state(folder: Path, pp_rank: int, tp: int, state: str) -> list[dict[str, torch.Tensor]]:
    """For each TP rank of pipeline stage `pp_rank`: parameter name -> its flat `state`, DP pieces joined."""
    out = []
    for t in range(tp):
        files = sorted(folder.glob(f"optim_pp{pp_rank:03d}_tp{t:02d}_dp*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder}: no optimizer shards for pp rank {pp_rank}, tp rank {t}")
        pieces: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
        for path in files:
            meta = read_meta(path)
            with safe_open(str(path), "pt") as f:
                flat = f.get_tensor(state)
            for name, lo, hi, off in meta["pieces"]:
                pieces.setdefault(name, []).append((lo, hi, flat[off: off + hi - lo]))
        joined = {}
        for name, parts in pieces.items():
            buf = torch.empty(max(hi for _, hi, _ in parts), dtype=torch.float32)
            for lo, hi, values in parts:
                buf[lo:hi] = values
            if sum(hi - lo for lo, hi, _ in parts) != buf.numel():
                raise CheckpointError(f"{folder}: optimizer shards of pp rank {pp_rank}, tp rank {t} do not cover "
                                      f"{name}")
            joined[name] = buf
        out.append(joined)
    return out


class OptimizerStateView(MPCheckpoint):
    """A training checkpoint seen as a model checkpoint whose tensors are one optimizer state."""

    def __init__(self, mp: str | Path, iteration: int | None, state: str, shared_layers: bool = False):
        super().__init__(mp, iteration)
        self.state = state
        self.saved_name = shared_name if shared_layers else (lambda name: name)
        self._stage: tuple[int, list[dict[str, torch.Tensor]]] | None = None

    def local(self, tp_rank: int, pp_rank: int, name: str) -> torch.Tensor:
        if self._stage is None or self._stage[0] != pp_rank:  # rules come in model order: stage by stage
            self._stage = (pp_rank, _stage_state(self.folder / OPTIM_DIR, pp_rank, self.layout.tp, self.state))
        flat = self._stage[1][tp_rank].get(self.saved_name(name))
        if flat is None:
            raise CheckpointError(f"{self.folder / OPTIM_DIR}: no optimizer state for {name} (pp rank {pp_rank}, "
                                  f"tp rank {tp_rank})")
        return flat.view(self.local_slice(tp_rank, pp_rank, name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return torch.float32


def _write_optimizer(source: MPCheckpoint, layout: MPLayout, iter_dir: Path) -> None:
    """The new layout's optimizer shards (DP=1) in `iter_dir/optim/`."""
    old_meta = read_meta(next((source.folder / OPTIM_DIR).glob("optim_*.safetensors")))
    shared = read_trainer_state(source.folder).get("shared_layers", False)
    work = iter_dir / ".optim_work"
    for state in STATE:
        (work / state).mkdir(parents=True)
        write_mp_shards(OptimizerStateView(source.folder, None, state, shared), source.cfg, layout, work / state,
                        torch.float32)
    (iter_dir / OPTIM_DIR).mkdir()
    for p in range(layout.pp):
        names = [rule.local for rule in rank_rules(source.cfg, layout, p)]
        for t in range(layout.tp):
            files = {s: work / s / layout.rank_dir(t, p) / RANK_FILE for s in STATE}
            _save_optimizer_shard(iter_dir, p, t, layout, old_meta,
                                  {n: {s: read_tensor(files[s], n) for s in STATE} for n in names})
    shutil.rmtree(work)


def _save_optimizer_shard(iter_dir: Path, p: int, t: int, layout: MPLayout, old_meta: dict,
                          states: dict[str, dict[str, torch.Tensor]]) -> None:
    """One new rank's optimizer shard (DP=1): parameter name -> {master, exp_avg, exp_avg_sq}, in order."""
    flats = {s: torch.cat([v[s].reshape(-1) for v in states.values()]) for s in STATE}
    pieces, off = [], 0
    for n, v in states.items():
        numel = v["master"].numel()
        pieces.append([n, 0, numel, off])
        off += numel
    meta = {**old_meta, "dp": 1, "tp": layout.tp, "pp": layout.pp, "pieces": pieces}
    meta.pop("writer", None)  # the rank that wrote the source shard; this one is written offline, by none
    save_tensors(flats, iter_dir / OPTIM_DIR / f"optim_pp{p:03d}_tp{t:02d}_dp000.safetensors",
                 {"hfmeg_optimizer": json.dumps(meta)})


def _carry_state(folder: Path, iter_dir: Path) -> None:
    """The trainer state, and a GRPO run's held generation batch where it has one, copied verbatim: neither depends
    on the layout (train/rollout_checkpoint.py)."""
    shutil.copyfile(folder / STATE_FILE, iter_dir / STATE_FILE)
    if (folder / ROLLOUT_DIR).is_dir():
        shutil.copytree(folder / ROLLOUT_DIR, iter_dir / ROLLOUT_DIR)


def _carry_rng(folder: Path, old: MPLayout, new: MPLayout, iter_dir: Path) -> None:
    """Write `iter_dir/rng/` for `new` from `folder`'s, when the pipeline split is the same (module docstring);
    the DP x CP size is the one the old files imply, which the resumed run must keep to use them."""
    files = sorted((folder / RNG_DIR).glob("rank_*.json"))
    if (old.pp, old.vpp, old.pp_layers) != (new.pp, new.vpp, new.pp_layers) or not files \
            or len(files) % (old.tp * old.pp):
        return
    replicas = len(files) // (old.tp * old.pp)  # DP x CP
    (iter_dir / RNG_DIR).mkdir()
    for p in range(new.pp):
        for m in range(replicas):
            src = folder / RNG_DIR / rng_file_name(old.tp * (m + replicas * p))  # TP rank 0 of (m, p)
            if not src.is_file():
                raise CheckpointError(f"{src}: missing; {folder / RNG_DIR} holds {len(files)} RNG states, not "
                                      "one per rank")
            for t in range(new.tp):
                shutil.copyfile(src, iter_dir / RNG_DIR / rng_file_name(t + new.tp * (m + replicas * p)))


def reshard_adapters(mp: str | Path, out: str | Path, *, tp: int, pp: int, vpp: int = 1,
                     pp_layers: list[int] | None = None, dtype: str = "auto", overwrite: bool = False,
                     iteration: int | None = None) -> Path:
    """A LoRA training checkpoint at TP x PP (x VPP): its adapter shards and their optimizer state (in the
    dtype they were trained in: `dtype` is the full model's option).

    The base is not in the checkpoint (it is read from the path `adapter.json` records, checked by its
    hash at resume), so only adapter tensors move: each is joined into its full PEFT tensor
    (`adapter_files.assemble`), its fp32 master and moments likewise (the old ranks' DP pieces joined by
    name, then the TP slices by the same split kinds), and all of them are cut for the new ranks by the
    trainer's own adapter code (`peft/layout_shards.py`). Values are moved, never recomputed."""
    folder = resolve_iteration_dir(mp, iteration)
    if not (folder / STATE_FILE).is_file():
        raise CheckpointError(f"{folder}: not a training checkpoint (no {STATE_FILE})")
    cfg, _ = read_info(folder)
    old = check_adapter_shards(folder, cfg)
    model_cfg = as_saved(load_model_config(folder / HF_DIR), old.model_config)
    with config_errors_name(folder / HF_DIR):
        layout = MPLayout.build(model_cfg, tp=tp, pp=pp, vpp=vpp, pp_layers=pp_layers,
                                vocab_multiple=old.vocab_multiple, dtype=old.dtype, iteration=old.iteration)
    coords = {old.rank_dir(t, p): (t, p) for p in range(old.pp) for t in range(old.tp)}
    stages: dict[tuple[str, int], list[dict[str, torch.Tensor]]] = {}

    def state_of(kind: str):
        def value(rank_dir: Path, local: str, saved: torch.Tensor) -> torch.Tensor:
            t, p = coords[rank_dir.name]
            if (kind, p) not in stages:
                stages[(kind, p)] = _stage_state(folder / OPTIM_DIR, p, old.tp, kind)
            flat = stages[(kind, p)][t].get(local)
            if flat is None:
                raise CheckpointError(f"{folder / OPTIM_DIR}: no optimizer state for {local} (pp rank {p}, "
                                      f"tp rank {t})")
            return flat.view(saved.shape)
        return value

    tensors = assemble(folder)
    states = {s: assemble(folder, state_of(s)) for s in STATE}
    old_meta = read_meta(next((folder / OPTIM_DIR).glob("optim_*.safetensors")))
    with atomic_output_dir(out, overwrite=overwrite, inputs=(folder,)) as tmp:
        iter_dir = tmp / iteration_dir_name(layout.iteration)
        iter_dir.mkdir()
        write_layout_shards(iter_dir, model_cfg, layout, cfg, tensors)
        (iter_dir / OPTIM_DIR).mkdir()
        per_state = [rank_adapters(model_cfg, layout, cfg, states[s]) for s in STATE]
        for ranks in zip(*per_state):
            ps = ranks[0][0]
            named = [local_tensors(chunks) for _, chunks in ranks]
            _save_optimizer_shard(iter_dir, ps.pp_rank, ps.tp_rank, layout, old_meta,
                                  {n: {s: named[i][n] for i, s in enumerate(STATE)} for n in named[0]})
        layout.write(iter_dir)
        copy_hf_side_files(folder / HF_DIR, iter_dir / HF_DIR)
        shutil.copyfile(folder / INFO_FILE, iter_dir / INFO_FILE)
        _carry_state(folder, iter_dir)
        _carry_rng(folder, old, layout, iter_dir)
        write_latest(tmp, layout.iteration)
    return Path(out)


def reshard_full(mp: str | Path, out: str | Path, *, tp: int, pp: int, vpp: int = 1, pp_layers: list[int] | None = None,
                 dtype: str = "auto", overwrite: bool = False, iteration: int | None = None) -> Path:
    """A full model's training checkpoint at TP x PP (x VPP): model shards, optimizer state, RNG, trainer state."""
    source = MPCheckpoint(mp, iteration)
    state_file = source.folder / STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(f"{source.folder}: not a training checkpoint (no {STATE_FILE})")
    with config_errors_name(source.hf_dir):
        layout = MPLayout.build(source.cfg, tp=tp, pp=pp, vpp=vpp, pp_layers=pp_layers,
                                vocab_multiple=source.layout.vocab_multiple, iteration=source.layout.iteration)

    def extra(iter_dir: Path) -> None:
        _write_optimizer(source, layout, iter_dir)
        _carry_state(source.folder, iter_dir)
        _carry_rng(source.folder, source.layout, layout, iter_dir)

    return write_mp_checkpoint(source, source.cfg, layout, source.hf_dir, out, dtype=parse_dtype(dtype),
                               overwrite=overwrite, inputs=(Path(mp),), extra=extra)
