"""`FullModel`: every parameter trained; checkpoints hold model shards, the export is `<out>/hf`.

With `train.shared_layers_until` every layer shares layer 0's parameters until that step
(`models/shared_layers.py`); the trainer then rebuilds the part unshared through a checkpoint at that step
(`rebuild_note`). A checkpoint's `shared_layers` entry records the phase it was saved in: the unshared model
built from a shared-phase one (at the unlock, or a resume after it) takes every layer's optimizer state from
layer 0's names (`optimizer_names`); a shared run cannot resume an unshared checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from ...checkpoint.convert import mp_to_hf
from ...errors import CheckpointError
from ...models.shared_layers import share_layers, shared_name
from ..reshard_checkpoint import reshard_full
from .adapters import check_resume_settings
from .base import ModelPart
from .reference import Reference


class FullModel(ModelPart):
    def _shared_at(self, step: int) -> bool:
        return step < self.cfg.train.shared_layers_until

    def check_resume(self, resume: Path) -> None:
        check_resume_settings(resume, self.cfg.peft)

    def build(self, resume: Path | None, step: int):
        chunks, side = self.load(resume)
        self.layers_shared = self._shared_at(step)
        if self.layers_shared:
            for chunk in chunks:
                share_layers(chunk)
        return chunks, side

    def reference(self, chunks) -> Reference:
        """A frozen copy of the configured model (never the resumed checkpoint), laid out like `chunks`."""
        frozen, _ = self.load(None)
        for chunk in frozen:
            chunk.requires_grad_(False)
        return Reference(frozen)

    def optimizer_names(self, saved: dict):
        saved_shared = saved.get("shared_layers", False)
        if saved_shared == self.layers_shared:
            return None
        if self.layers_shared:
            raise CheckpointError(f"train.shared_layers_until: the checkpoint at step {saved['step']} has unshared "
                                  f"layers, but this run shares them until step {self.cfg.train.shared_layers_until}"
                                  "; unshared layers cannot be shared again")
        return shared_name

    def rebuild_note(self, step: int) -> str | None:
        if self.layers_shared and not self._shared_at(step):
            return f"step {step}: layers unlocked (train.shared_layers_until)"
        return None

    @classmethod
    def export(cls, checkpoint: Path, out: Path) -> tuple[Path, Path | None]:
        return mp_to_hf(checkpoint, out / "hf", overwrite=True), None

    @classmethod
    def reshard(cls, mp, out, **layout) -> Path:
        return reshard_full(mp, out, **layout)
