"""The model parts a run trains with (`base.ModelPart`), and the one place that picks a kind: from the
config (`part_class`: `peft.method` none is a `FullModel`, lora/dora `Adapters`) or from what a saved
checkpoint holds (`saved_part`: adapter shards and `adapter.json`, or model shards)."""

from __future__ import annotations

from pathlib import Path

from ...checkpoint.mp_layout import resolve_iteration_dir
from ...peft.export import is_adapter_checkpoint
from ..config import TrainConfig
from .adapters import Adapters
from .base import ModelPart
from .full import FullModel


def part_class(cfg: TrainConfig) -> type[ModelPart]:
    """The kind of model part the run `cfg` trains."""
    return Adapters if cfg.peft.enabled else FullModel


def saved_part(folder: Path) -> type[ModelPart]:
    """The kind of model part that saved the iteration folder `folder`."""
    return Adapters if is_adapter_checkpoint(folder) else FullModel


def reshard_training_checkpoint(mp: str | Path, out: str | Path, *, tp: int, pp: int, vpp: int = 1,
                                pp_layers: list[int] | None = None, dtype: str = "auto", overwrite: bool = False,
                                iteration: int | None = None) -> Path:
    """Write the training checkpoint `mp` at layout TP x PP (x VPP) to `out` (same iteration number)."""
    part = saved_part(resolve_iteration_dir(mp, iteration))
    return part.reshard(mp, out, tp=tp, pp=pp, vpp=vpp, pp_layers=pp_layers, dtype=dtype, overwrite=overwrite,
                        iteration=iteration)
