"""A merged HF folder: the base's weights with every LoRA update folded in, `W + scale B A`
(DoRA: that, each row rescaled to its trained magnitude).

Streamed one base weight file at a time (`safe_open`): each targeted projection's
weight gets `(B @ A) * scale` added, computed in fp32 and cast back to the base's
dtype, as `peft`'s `merge_and_unload` does; a module trained in full (`modules_to_save`) replaces the
base's tensor; every other tensor and every other file
(config, tokenizer, generation config, the shard index) is copied verbatim, so
`AutoModelForCausalLM.from_pretrained` loads the folder alone.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..checkpoint.atomic import atomic_output_dir
from ..errors import CheckpointError
from .adapters import PEFT_PREFIX


def _merged(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, magnitude: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """`W + scale B A`; with DoRA's `magnitude` m, that times m / (its row norms)."""
    full = w.float() + (b @ a) * scale
    if magnitude is not None:
        full = full * (magnitude.float() / torch.linalg.norm(full, dim=1)).unsqueeze(1)
    return full.to(w.dtype)


def merge_into_hf(base: Path, tensors: dict[str, torch.Tensor], scale: float, out: Path, *,
                  overwrite: bool = True) -> Path:
    """Write `base` (an HF folder) with the PEFT `tensors` merged in to `out`, atomically."""
    base = Path(base)
    updates = {k.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight") + ".weight": k
               for k in tensors if k.endswith(".lora_A.weight")}
    merged = set()
    with atomic_output_dir(out, overwrite=overwrite, inputs=(base,)) as tmp:
        for path in sorted(base.iterdir()):
            if path.suffix == ".safetensors":
                weights = {}
                with safe_open(str(path), "pt") as f:
                    meta = f.metadata()
                    for name in f.keys():
                        w = f.get_tensor(name)
                        if PEFT_PREFIX + name in tensors:  # a module trained in full (modules_to_save)
                            w = tensors[PEFT_PREFIX + name].to(w.dtype)
                            merged.add(name)
                        elif name in updates:
                            a = tensors[updates[name]].float()
                            b = tensors[updates[name].replace(".lora_A.", ".lora_B.")].float()
                            w = _merged(w, a, b, tensors.get(updates[name].replace(".lora_A.weight",
                                                                                   ".lora_magnitude_vector")), scale)
                            merged.add(name)
                        weights[name] = w
                save_file(weights, str(tmp / path.name), metadata=meta)
            elif path.is_file() and path.suffix != ".bin":
                shutil.copy2(path, tmp / path.name)
        saved = {k.removeprefix(PEFT_PREFIX) for k in tensors if ".lora_" not in k}
        missing = sorted((set(updates) | saved) - merged)
        if missing:
            raise CheckpointError(f"{base}: no base weight {missing[0]} for its adapter (the adapter was trained on "
                                  "another model)")
    return Path(out)
