"""Sharded optimizer-state checkpoints that reload at a different DP size.

Each rank that owns state writes one safetensors file
`optim_pp{PP}_tp{TP}_dp{DP}.safetensors` (DP: the rank's index in the DP x CP group
that shards the optimizer, `ParallelState.dp_cp_rank`) holding its flat fp32 `master`,
`exp_avg` and `exp_avg_sq` tensors; the safetensors metadata holds one JSON
document: the AdamW step, loss-scaler state, skip count, the DP size and, for every
owned piece of a parameter, `[name, lo, hi, offset]` (elements [lo, hi) of the
flattened parameter live at [offset, offset + hi - lo) of the flat tensors).
In `ddp` mode every DP rank holds everything, so only DP rank 0 writes (with expert
parallelism, also the other EP ranks of its EP group, each only its own experts:
`DataParallel.primary`). With EP > 1 the routed experts' state is sharded over the
expert-DP group instead; their names carry the global expert index, so the pieces of
all files of a (PP, TP) coordinate hold every expert once, whatever the EP size. The
metadata also holds `iteration`, the steps taken, which decides when compression starts,
and `writer`, the global rank that wrote the file (a checkpoint on a path many hosts share
shows its writers; one JSON document, as safetensors orders several metadata keys by chance).

With PowerSGD configured, every rank also writes `powersgd_pp{PP}_tp{TP}_dp{DP}.safetensors`:
Q and the residual of each compressed matrix (`PowerSGD.state_dict`), during the
warm-up too, so a resume on either side of the switch is exact. Residuals are a
rank's own, so they are restored only at the same DP size (and PowerSGD rank); any
other resume starts the compression state afresh, with a warning.

Loading re-partitions by name: each rank reads the files of its own (PP, TP)
coordinates, whatever DP size wrote them, and copies the overlap of every saved
piece with every piece it now owns (bucket layouts depend on DP, names do not).
Then the master weights are cast into the model parameters and all-gathered, so
the model and the optimizer agree. Files are written to a temporary sibling and
renamed; nothing is ever unpickled.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from ..checkpoint.atomic import save_tensors
from ..errors import CheckpointError, HfmegError
from ..parallel.agree import agree
from ..parallel.stored_names import stored_slices
from .distributed_optimizer import DistributedOptimizer

log = logging.getLogger("hfmeg.optim")

FORMAT = 1
STATE = ("master", "exp_avg", "exp_avg_sq")


def _pieces(opt: DistributedOptimizer, primary_only: bool = False) -> list[list]:
    """[name, lo, hi, offset] of every parameter piece this rank holds (`primary_only`: that it writes),
    by stored name: a piece of a stacked parameter becomes pieces of its slices (parallel/stored_names.py)."""
    dp, out = opt.data_parallel, []
    stacked = [stored_slices(c) for c in dp.chunks]
    for b in opt.buckets:
        if primary_only and not dp.primary(b):
            continue
        rank = dp.shard_rank(b)
        base = opt.offsets[b.index] - rank * b.shard_size
        for slot, lo, hi in b.segments(rank):
            slices = stacked[b.chunk].get(slot.name)
            if slices is None:
                out.append([slot.name, lo, hi, base + slot.offset + lo])
                continue
            per = slot.numel // len(slices)
            for j, name in enumerate(slices):
                a, z = max(lo, j * per), min(hi, (j + 1) * per)
                if a < z:
                    out.append([name, a - j * per, z - j * per, base + slot.offset + a])
    return out


def _step_tensor(opt: DistributedOptimizer) -> torch.Tensor | None:
    return next((s["step"] for s in opt.adam_states()), None)


def save_optimizer_state(opt: DistributedOptimizer, folder: str | Path) -> Path | None:
    """Write this rank's shard into `folder` (created if needed); returns the file written, if any."""
    ps = opt.ps
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    compressor = opt.data_parallel.compressor
    if compressor is not None:
        _write(_file(folder, "powersgd", ps, ps.dp_cp_rank), compressor.state_dict(),
               {"format": FORMAT, "dp": ps.dp_cp, "powersgd_rank": opt.cfg.powersgd_rank, "writer": ps.rank})
    if not any(opt.data_parallel.primary(b) for b in opt.buckets):
        return None
    opt.wait_params()
    step = _step_tensor(opt)
    meta = {
        "format": FORMAT, "dp": opt.shards, "mode": opt.cfg.mode, "tp": ps.tp, "pp": ps.pp,
        "step": float(step.item()) if step is not None else 0.0, "skipped_steps": opt.skipped_steps,
        "iteration": opt.iteration,
        "loss_scale": opt.loss_scale, "good_steps": opt.scaler.good_steps if opt.scaler else 0,
        "pieces": _pieces(opt, primary_only=True), "writer": ps.rank,
    }
    path = _file(folder, "optim", ps, ps.dp_cp_rank)
    _write(path, {"master": opt.master, "exp_avg": opt.exp_avg, "exp_avg_sq": opt.exp_avg_sq}, meta)
    return path


def _file(folder: Path, kind: str, ps, dp_rank: int) -> Path:
    return folder / f"{kind}_pp{ps.pp_rank:03d}_tp{ps.tp_rank:02d}_dp{dp_rank:03d}.safetensors"


def _write(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Write `tensors` with `meta` as the hfmeg_optimizer metadata, through a temporary sibling."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        save_tensors({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp,
                     {"hfmeg_optimizer": json.dumps(meta)})
    except (OSError, SafetensorError) as e:  # e.g. a full disk
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"{path}: cannot write the optimizer shard ({e})") from e
    os.replace(tmp, path)


def read_meta(path: Path) -> dict:
    """The JSON metadata of an optimizer shard file (step, DP size, the pieces it holds), checked."""
    try:
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {})["hfmeg_optimizer"])
    except (KeyError, OSError, ValueError, SafetensorError) as e:  # SafetensorError: e.g. a truncated file
        raise CheckpointError(f"{path}: not an hfmeg optimizer shard, or truncated ({e})") from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: field format is {meta.get('format')!r}, expected {FORMAT}")
    return meta


def load_optimizer_state(opt: DistributedOptimizer, folder: str | Path,
                         source_name: Callable[[str], str] | None = None) -> None:
    """Collective: fill `opt` (any DP size and mode) from the shards in `folder`, then resync the parameters.

    `source_name(name)`: the saved tensor whose state parameter `name` takes (default: its own
    name). The shared-unlock warm start (models/shared_layers.py) gives every layer the state
    saved under the first layer's names. Each rank reads its own files; the ranks agree on the
    outcome (`parallel.agree`) before the parameters' all-gathers, so a damaged or missing shard
    is the same one error on every rank instead of a hang."""
    error = None
    try:
        _read_state(opt, Path(folder), source_name)
    except HfmegError as e:
        error = e
    agree(error, opt.ps.device)
    opt.publish_params()
    opt.wait_params()
    if dist.is_initialized() and opt.ps.world_size > 1:
        dist.barrier()


def _read_state(opt: DistributedOptimizer, folder: Path, source_name: Callable[[str], str] | None) -> None:
    """This rank's local part of `load_optimizer_state`: read its pieces and scalars into `opt`."""
    ps = opt.ps
    files = sorted(folder.glob(f"optim_pp{ps.pp_rank:03d}_tp{ps.tp_rank:02d}_dp*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no optimizer shards for pp rank {ps.pp_rank}, tp rank {ps.tp_rank}")
    mine: dict[str, list[tuple[int, int, int, str]]] = {}  # saved name -> pieces (lo, hi, offset, own name)
    need: dict[str, int] = {}  # own name -> elements this rank holds
    for name, lo, hi, off in _pieces(opt):
        mine.setdefault(source_name(name) if source_name else name, []).append((lo, hi, off, name))
        need[name] = need.get(name, 0) + hi - lo
    filled = dict.fromkeys(need, 0)
    meta = {}
    for path in files:
        meta = read_meta(path)
        if (meta["tp"], meta["pp"]) != (ps.tp, ps.pp):
            raise CheckpointError(f"{path}: fields tp/pp are {meta['tp']}/{meta['pp']}, this run has {ps.tp}/{ps.pp}")
        flats = _tensors(path, STATE)
        for name, lo, hi, off in meta["pieces"]:
            for my_lo, my_hi, my_off, my_name in mine.get(name, ()):
                a, b = max(lo, my_lo), min(hi, my_hi)
                if a >= b:
                    continue
                for k in STATE:
                    getattr(opt, k)[my_off + a - my_lo : my_off + b - my_lo].copy_(flats[k][off + a - lo : off + b - lo])
                filled[my_name] += b - a
    missing = sorted(n for n in need if filled[n] != need[n])
    if missing:
        raise CheckpointError(f"{folder}: optimizer shards do not cover {missing[0]} (and {len(missing) - 1} more)")
    for s in opt.adam_states():
        s["step"].fill_(meta["step"])
    opt.skipped_steps = meta["skipped_steps"]
    # Files from before steps were counted: a step either updated (AdamW's step) or was skipped.
    opt.set_iteration(meta.get("iteration", int(meta["step"]) + meta["skipped_steps"]))
    if opt.data_parallel.compressor is not None:
        _load_compression(opt, folder)
    if opt.scaler is not None:
        opt.scaler.scale, opt.scaler.good_steps = meta["loss_scale"], meta["good_steps"]


def _tensors(path: Path, names) -> dict[str, torch.Tensor]:
    """The named tensors of a shard file (all of them for `names` None), or one line naming the file."""
    try:
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in (f.keys() if names is None else names)}
    except (OSError, SafetensorError) as e:  # a file damaged past its header
        raise CheckpointError(f"{path}: unreadable ({e})") from e


def _load_compression(opt: DistributedOptimizer, folder: Path) -> None:
    """Restore Q and the residuals from this rank's file, or leave them fresh (see the module docstring)."""
    ps, state = opt.ps, opt.data_parallel.compressor.state_dict()
    path = _file(folder, "powersgd", ps, ps.dp_cp_rank)
    why = None
    if not path.is_file():
        why = f"no {path.name}"
    else:
        meta = read_meta(path)
        saved = _tensors(path, None)
        if meta["dp"] != ps.dp_cp:
            why = f"written at DP x CP size {meta['dp']}, this run has {ps.dp_cp}"
        elif not all(k in saved and saved[k].shape == t.shape for k, t in state.items()):
            why = "written for other matrices or another powersgd_rank"
    if why is None:
        for k, t in state.items():
            t.copy_(saved[k])
    elif opt.iteration > opt.cfg.compression_start_step:  # a compressed step has run: its residuals are lost
        log.warning("%s: PowerSGD state starts afresh (%s)", folder, why)
