"""`ModelPart`: what the trainer asks of a model it holds, so that it never asks which kind it holds.

A part is one model of a run, as this rank's chunks. Each kind answers the same questions:
- `build`: its chunks, from the configured model or from the checkpoint it resumes (after
  `check_resume`, which names a changed setting before a missing file could), with `requires_grad` on
  exactly the parameters it trains (the optimizer takes those); `check_base`, a collective after the
  ranks agreed on `build`, for what rank 0 alone checks (an adapter run's base fingerprint);
- checkpoints: `write_model` writes its tensors into each rank's folder, `checkpoint_state` its entries of
  `trainer_state.json`; `optimizer_names` says where its parameters find their optimizer state in a saved
  one, `resume_note` what a resume that restored no RNG state changes for it;
- `rebuild_note`: whether it must be rebuilt through a checkpoint at this step (a full model unsharing its
  layers), and the line that says so;
- `reference`: the reference model of a preference run (parts/reference.py: a frozen copy of the
  configured model, or for adapters the base with them switched off);
- the live weights as the export would give them, no checkpoint written (online RL's weight push):
  `export_live` (an HF folder), `live_weights` (the tensors that change, for a model held in memory);
- classmethods, on a checkpoint alone: `export` (`<out>/hf`, and for adapters `<out>/adapter`),
  `reshard` (to another TP x PP x VPP), `base_of` (the base an export names; pushes check it).
Kinds: `FullModel` (full.py), `Adapters` (adapters.py); `parts/__init__.py` picks one from the config or a
checkpoint.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable, Iterator

import torch
from transformers import AutoConfig

from ...checkpoint.convert import shards_to_hf
from ...checkpoint.hf_reader import HFCheckpoint
from ...checkpoint.hf_writer import exported_names
from ...checkpoint.live_shards import live_shards
from ...checkpoint.load import load_chunks
from ...checkpoint.mp_layout import HF_DIR, is_mp_folder, resolve_iteration_dir
from ...checkpoint.mp_reader import MPCheckpoint
from ...checkpoint.mp_save import write_model_shard
from ...checkpoint.tensor_source import TensorSource
from ...errors import UnsupportedConfigError
from ...families import text_config
from ...models.random_init import random_hf_model
from ..config import TrainConfig
from .reference import Reference


def _random_weights(folder: Path, seed: int) -> TensorSource:
    """Weights for pretraining from scratch: transformers' own initialisation of `folder`'s config.

    Every rank initialises the whole model on its CPU with the same seed (so the TP ranks agree)
    and takes its slices through the loader, as from a checkpoint. A multimodal wrapper is refused: its vision tower
    would have no weights to carry into the export."""
    config = AutoConfig.from_pretrained(folder)
    if text_config(config) is not config:
        raise UnsupportedConfigError(f"model.init: random on a multimodal checkpoint (config.json model_type "
                                     f"{config.model_type!r}) is not supported; start from its weights")
    return TensorSource.snapshot(random_hf_model(config, seed=seed, dtype=torch.float32))


class ModelPart(ABC):
    layers_shared = False  # whether the chunks share layer 0's parameters (`train.shared_layers_until`)
    fp8_said = False  # whether the `model.fp8` start-up lines were printed

    def __init__(self, cfg: TrainConfig, ps, dtype: torch.dtype):
        self.cfg, self.ps, self.dtype = cfg, ps, dtype

    def load(self, checkpoint: Path | None):
        """This rank's chunks from `checkpoint` (an iteration folder), else from `model.path` (an hfmeg shard
        folder, an HF model, or `model.init: random`); and the folder of the HF side files (config, tokenizer)."""
        m = self.cfg.model
        if checkpoint is None and is_mp_folder(Path(m.path)):
            checkpoint = Path(m.path)
        if checkpoint is not None:
            iter_dir = resolve_iteration_dir(checkpoint)
            return self._chunks(MPCheckpoint(iter_dir)), iter_dir / HF_DIR
        side = m.hf_folder()
        weights = _random_weights(side, self.cfg.train.seed) if m.init == "random" else HFCheckpoint(side)
        return self._chunks(weights, pp_layers=self.cfg.parallel.pp_layers, vocab_multiple=m.vocab_multiple), side

    def _chunks(self, weights, **layout):
        m = self.cfg.model
        chunks = load_chunks(weights, self.ps, dtype=self.dtype, recompute=m.recompute,
                             ce_chunk_tokens=m.ce_chunk_tokens, compile_backend="inductor" if m.compile else None,
                             **layout)
        if m.fp8 != "off":  # a compute recipe: set on the built layers, nothing saved or loaded changes
            from ...models.fp8 import convert_fp8  # imports torchao, which only FP8 runs need

            lines = convert_fp8(chunks, m.fp8, m.fp8_exclude, self.ps)
            if self.ps.rank == 0 and not self.fp8_said:
                print("\n".join(lines), flush=True)
                self.fp8_said = True  # once a run, not again for a reference model or a rebuild
        return chunks

    @abstractmethod
    def check_resume(self, resume: Path) -> None:
        """Refuse, naming the setting, a checkpoint saved with settings this part cannot continue from."""

    @abstractmethod
    def build(self, resume: Path | None, step: int):
        """(chunks, HF side folder) at `step`, from `resume` (an iteration folder) or the configured model."""

    @abstractmethod
    def reference(self, chunks) -> Reference:
        """The reference model a preference loss compares `chunks` (this part's, as built) with."""

    def check_base(self, saved: dict) -> None:
        """Collective, after the ranks agreed on `build`: checks against the resumed trainer state `saved`."""

    def write_model(self, chunks, ps, layout, folder: Path) -> None:
        """A checkpoint's model tensors: this rank's shard of every parameter."""
        write_model_shard(chunks, ps, layout, folder)

    def export_live(self, chunks, layout, hf_dir: Path, out: Path) -> Path | None:
        """Collective: the live weights as the HF folder `out` their export would write (rank 0 writes it and gets
        its path; None elsewhere), from the shards gathered in memory (`checkpoint/live_shards.py`), no checkpoint
        written first. `layout`: the chunks' (`mp_save.chunks_layout`); `hf_dir`: the run's HF side files."""
        source = live_shards(chunks, self.ps, layout, hf_dir)
        return None if source is None else shards_to_hf(source, out, overwrite=True)

    def live_weights(self, chunks, layout, hf_dir: Path) -> Iterator[tuple[str, torch.Tensor]] | None:
        """Collective: on rank 0 (None elsewhere) the (HF name, tensor) pairs by which the live weights' export
        differs from an earlier one's (`export_live`'s): for a full model every tensor it writes, made as it makes
        them, lazily; for a model in memory to take over in place (train/rollout.py)."""
        source = live_shards(chunks, self.ps, layout, hf_dir)
        if source is None:
            return None
        return ((name, source.get(hf)) for name, hf in exported_names(source).items())

    def checkpoint_state(self) -> dict:
        """This part's entries of `trainer_state.json`, beside `shared_layers`."""
        return {}

    def optimizer_names(self, saved: dict) -> Callable[[str], str] | None:
        """Which saved parameter's optimizer state each parameter takes, from a checkpoint whose trainer state
        is `saved` (None: its own)."""
        return None

    def resume_note(self, not_restored: str) -> str | None:
        """What a resume that restored no RNG state (`not_restored` says why) changes, if anything."""
        return None

    def rebuild_note(self, step: int) -> str | None:
        """The line to print when the part must be rebuilt through a checkpoint before `step` runs; else None."""
        return None

    @classmethod
    @abstractmethod
    def export(cls, checkpoint: Path, out: Path) -> tuple[Path, Path | None]:
        """Rank 0: write `<out>/hf` (and what else the kind publishes) from `checkpoint`; (hf, adapter or None)."""

    @classmethod
    @abstractmethod
    def reshard(cls, mp: str | Path, out: str | Path, *, tp: int, pp: int, vpp: int, pp_layers: list[int] | None,
                dtype: str, overwrite: bool, iteration: int | None) -> Path:
        """The training checkpoint `mp` at layout TP x PP (x VPP), written to `out`."""

    @classmethod
    def base_of(cls, cfg: TrainConfig) -> str | None:
        """The base model the export names and needs (None: it stands alone)."""
        return None
