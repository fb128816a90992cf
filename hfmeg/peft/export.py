"""A LoRA training checkpoint, exported: the PEFT adapter folder and, on request, the merged HF model.

The checkpoint's iteration folder holds every rank's adapter shard (`adapter_files`)
and `adapter.json`, written with them: the `peft.*` settings and the base's reference
(`path`: Hub id or folder, `sha256`: `base_fingerprint` of its weight files). The
export assembles the PEFT tensors from the shards alone, so it runs in one process
whatever TP/PP wrote them; the merge reads the base named there and refuses one whose
weights changed since training.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

from ..checkpoint.atomic import atomic_output_dir
from ..checkpoint.hub_source import resolve_hf_source
from ..errors import CheckpointError
from .adapter_files import assemble, base_fingerprint, check_adapter_shards, write_peft_folder
from .config import PeftConfig
from .merge import merge_into_hf

INFO_FILE = "adapter.json"


def write_info(iter_dir: Path, cfg: PeftConfig, base: dict) -> None:
    """Record the run's `peft.*` settings and its base's reference (`{"path", "sha256"}`) in the checkpoint."""
    (iter_dir / INFO_FILE).write_text(json.dumps({"peft": asdict(cfg), "base": base}, indent=2) + "\n")


def is_adapter_checkpoint(iter_dir: Path) -> bool:
    return (Path(iter_dir) / INFO_FILE).is_file()


def read_info(iter_dir: Path) -> tuple[PeftConfig, dict]:
    path = Path(iter_dir) / INFO_FILE
    try:
        info = json.loads(path.read_text())
        return PeftConfig(**info["peft"]), info["base"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e}); the LoRA checkpoint is incomplete") from e


def checked_base(base: dict, where: Path) -> Path:
    """The base's local folder, refused if its weights are not the ones the adapters were trained on."""
    folder = resolve_hf_source(base["path"])
    if base_fingerprint(folder) != base["sha256"]:
        raise CheckpointError(f"{where}: the base {base['path']} has changed since the adapters were trained on it "
                              f"(sha256 of its weights is no longer {base['sha256'][:12]}…)")
    return folder


def export_checkpoint(iter_dir: Path, out: Path, *, merged: Path | None = None,
                      overwrite: bool = False) -> Path:
    """Write the PEFT adapter folder `out` (and the merged HF folder `merged`) from a LoRA checkpoint, its shards
    checked first (`check_adapter_shards`). The pair is all-or-nothing: both are staged in temporary folders
    and renamed into place only once both are written, so a failure in either leaves neither."""
    iter_dir = Path(iter_dir)
    cfg, base = read_info(iter_dir)
    check_adapter_shards(iter_dir, cfg)
    tensors = assemble(iter_dir)
    folder = checked_base(base, iter_dir) if merged is not None else None
    with ExitStack() as stack:
        staged = stack.enter_context(atomic_output_dir(out, overwrite=overwrite, inputs=(iter_dir,)))
        if folder is not None:
            staged_merge = stack.enter_context(atomic_output_dir(merged, overwrite=overwrite,
                                                                 inputs=(iter_dir, folder, Path(out))))
            merge_into_hf(folder, tensors, cfg, staged_merge, overwrite=True)
        write_peft_folder(staged, tensors, cfg, base["path"], overwrite=True)
    return Path(out)
