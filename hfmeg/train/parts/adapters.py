"""`Adapters`: LoRA/DoRA adapters trained on a frozen base; their checkpoints, export and reshard.

- Start: the base is loaded from `model.path` as for full fine-tuning, then every chunk
  is frozen and gets its adapters (`peft/adapters.py`) before the optimizer is built,
  so only adapters get main grads, fp32 masters and Adam moments. They start from the
  resumed checkpoint's shards, else from `peft.init_from` (a PEFT adapter folder, whose
  method (LoRA or DoRA), r, alpha, targets, rslora and modules_to_save then rule), else fresh (A drawn from `train.seed`, B = 0).
- Checkpoints hold each rank's adapter shard in place of its model shard, and (in
  `adapter.json` and the trainer state) the base's reference: `model.path` (absolute when local) and the sha256
  of its weight files (`base_fingerprint`, computed by rank 0). A resume against a base whose hash changed
  is refused in one line on every rank, and so is one with other `peft.*` settings (`check_resume_settings`,
  a change of method named as such) or a damaged shard (`read_adapter_shard`: every rank checks its own file
  and the folder's rank folders; the trainer agrees on the first error).
- Export (rank 0, end of run): `<out>/adapter` is the PEFT adapter folder, naming its base by Hub id
  or absolute path (`write_peft_folder`), `<out>/hf` the base with the adapters merged in.
- Reshard: only the adapters and their optimizer state move (`reshard_checkpoint.reshard_adapters`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

from ...checkpoint.hub_ids import absolute
from ...checkpoint.hub_source import resolve_hf_source
from ...checkpoint.load import check_layout
from ...checkpoint.mp_layout import MPLayout
from ...config import load_hf_config
from ...errors import CheckpointError
from ...peft.adapter_files import (
    SHARD_FILE,
    base_fingerprint,
    live_adapters,
    read_adapter_shard,
    read_peft_folder,
    write_adapter_shard,
)
from ...peft.adapters import adapters_off, attach, check_unwrapped, initialise
from ...peft.config import PeftConfig
from ...peft.export import INFO_FILE, export_checkpoint, is_adapter_checkpoint, read_info, write_info
from ...peft.merge import Merge, merge_into_hf
from ..reshard_checkpoint import reshard_adapters
from .base import ModelPart
from .reference import Reference

ADAPTER_DIR = "adapter"
# The peft.* settings that shape or scale the adapters: a resume must keep them (dropout may change).
# A 4-bit base's block size is its source's (64 when quantized here), which the base's sha256 already pins.
RESUME_SETTINGS = ("r", "alpha", "target_modules", "use_rslora", "modules_to_save", "quantize", "double_quant",
                   "compute_dtype")


def check_resume_settings(resume: Path, cfg: PeftConfig) -> None:
    """Refuse, naming the setting, a resume whose `peft.*` differs from the run that saved `resume`: a full
    fine-tune's checkpoint resumed with adapters or back (peft.method), or other ranks, targets, scale."""
    if not is_adapter_checkpoint(resume):
        if any(resume.glob(f"mp_rank_*/{SHARD_FILE}")):
            raise CheckpointError(f"{resume / INFO_FILE}: missing; the checkpoint holds adapter shards but not their "
                                  "settings and base")
        if cfg.enabled:
            raise CheckpointError(f"peft.method: {resume} was saved by a full fine-tune (peft.method none), but this "
                                  f"run trains {cfg.method} adapters; resume with --peft none, or train adapters on "
                                  "its model in another --out (--model it)")
        return
    saved, _ = read_info(resume)
    if saved.method != cfg.method:
        how = f"this run trains {cfg.method} adapters" if cfg.enabled else "this run is a full fine-tune"
        raise CheckpointError(f"peft.method: {resume} was saved by a {saved.method} run (adapters on a frozen base, "
                              f"{INFO_FILE}), but {how}; resume with --peft {saved.method}")
    for name in RESUME_SETTINGS:
        was, now = getattr(saved, name), getattr(cfg, name)
        if (sorted(was) != sorted(now)) if isinstance(was, list) else was != now:
            raise CheckpointError(f"peft.{name}: {resume / INFO_FILE} was saved with {was!r}, this run has {now!r}; "
                                  "resume with the checkpoint's peft settings, or start a new run in another --out")


class Adapters(ModelPart):
    def __init__(self, cfg, ps, dtype):
        super().__init__(cfg, ps, dtype)
        self.base, self.seed = cfg.model.path, cfg.train.seed
        self.init_tensors = None
        peft = cfg.peft
        if peft.init_from:
            folder_cfg, self.init_tensors = read_peft_folder(resolve_hf_source(peft.init_from, weights=False))
            peft = replace(peft, method=folder_cfg.method, r=folder_cfg.r, alpha=folder_cfg.alpha,
                           target_modules=folder_cfg.target_modules, use_rslora=folder_cfg.use_rslora,
                           modules_to_save=folder_cfg.modules_to_save)
        if peft.quantize is not None and peft.compute_dtype is None:  # recorded as run, so a resume compares it
            peft = replace(peft, compute_dtype=cfg.model.dtype)
        self.peft = peft
        self.base_ref: dict | None = None  # the base's path and sha256 (`check_base`)
        self.base_dir: Path | None = None  # the folder rank 0 fingerprinted (`check_base`), what a push merges into

    def check_resume(self, resume: Path) -> None:
        check_resume_settings(resume, self.peft)

    def _chunks(self, weights, **layout):
        return super()._chunks(weights, base_4bit=self.peft.base_4bit(), **layout)

    def build(self, resume: Path | None, step: int):
        """The base from `model.path` (a checkpoint holds adapters, not the base), frozen, with its adapters
        filled (see the module docstring); every rank checks the resumed folder's ranks and its own shard."""
        chunks, side = self.load(None)
        check_unwrapped(load_hf_config(side), self.peft)
        for chunk in chunks:
            attach(chunk, self.peft)
            initialise(chunk, self.peft, self.seed, None if resume is not None else self.init_tensors)
        if resume is not None:
            layout = MPLayout.read(resume)
            check_layout(layout, self.ps, resume)
            layout.check_rank_dirs(resume)
            read_adapter_shard(chunks, resume / layout.rank_dir(self.ps.tp_rank, self.ps.pp_rank), self.ps.tp_rank)
        return chunks, side

    def check_base(self, saved: dict) -> None:
        """Rank 0 fingerprints the base for every rank; refuses (on every rank) a base that changed since `saved`."""
        ref = [None]
        if self.ps.rank == 0:
            self.base_dir = resolve_hf_source(self.base)
            # absolute: the converters read the base from the checkpoint, from whatever directory they run in
            ref[0] = {"path": absolute(self.base), "sha256": base_fingerprint(self.base_dir)}
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(ref, src=0)
        was = saved.get("peft_base")
        if was is not None and was.get("sha256") != ref[0]["sha256"]:
            raise CheckpointError(f"model.path {self.base}: its weights differ from the base the checkpoint's "
                                  f"adapters were trained on (sha256 {ref[0]['sha256'][:12]}… vs "
                                  f"{str(was.get('sha256'))[:12]}…); resume with that base")
        self.base_ref = ref[0]

    def reference(self, chunks) -> Reference:
        """The base: `chunks` with their adapters switched off (no second copy)."""
        return Reference(chunks, lambda: adapters_off(chunks))

    def write_model(self, chunks, ps, layout, folder: Path) -> None:
        """This rank's adapter shard in place of a model shard, and (rank 0) `adapter.json`."""
        write_adapter_shard(chunks, ps, folder / layout.rank_dir(ps.tp_rank, ps.pp_rank))
        if ps.rank == 0:
            write_info(folder, self.peft, self.base_ref)

    def checkpoint_state(self) -> dict:
        return {"peft_base": self.base_ref}

    def resume_note(self, not_restored: str) -> str | None:
        if self.peft.dropout > 0:
            return (f"resume not exact: {not_restored}; peft.dropout {self.peft.dropout} draws other masks "
                    "than the uninterrupted run from here on")
        return None

    def export_live(self, chunks, layout, hf_dir: Path, out: Path) -> Path | None:
        """The base with the live adapters merged in (`merge_into_hf`, as the export's `hf/`); no PEFT folder. The
        base is the folder `check_base` fingerprinted at the start (rank 0, which holds the live adapters), neither
        hashed nor resolved again each push: a Hub id's newer revision cannot slip in mid-run."""
        tensors = live_adapters(chunks, self.ps)
        return None if tensors is None else merge_into_hf(self.base_dir, tensors, self.peft, out)

    def live_weights(self, chunks, layout, hf_dir: Path):
        """The merged weights of the projections the adapters change (`Merge.adapted`): the others stay the base's."""
        tensors = live_adapters(chunks, self.ps)
        return None if tensors is None else Merge(self.base_dir, tensors, self.peft).adapted()

    @classmethod
    def export(cls, checkpoint: Path, out: Path) -> tuple[Path, Path | None]:
        """Rank 0: `<out>/adapter` (PEFT folder) and `<out>/hf` (merged), from the checkpoint's shards."""
        merged = out / "hf"
        adapter = export_checkpoint(checkpoint, out / ADAPTER_DIR, merged=merged, overwrite=True)
        print(f"LoRA adapter (PEFT format): {adapter}; merged model: {merged}")
        return merged, adapter

    @classmethod
    def reshard(cls, mp, out, **layout) -> Path:
        return reshard_adapters(mp, out, **layout)

    @classmethod
    def base_of(cls, cfg) -> str | None:
        return cfg.model.path
