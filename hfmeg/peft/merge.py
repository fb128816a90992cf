"""A merged HF folder: the base's weights with every LoRA update folded in, `W + scale B A`
(DoRA: that, each row rescaled to its trained magnitude).

Streamed one base weight file at a time (`safe_open`): each targeted projection's
weight gets `(B @ A) * scale` added, computed in fp32 and cast back to the base's
dtype, as `peft`'s `merge_and_unload` does; a module trained in full (`modules_to_save`) replaces the
base's tensor; every other tensor and every other file
(config, tokenizer, generation config, the shard index) is copied verbatim, so
`AutoModelForCausalLM.from_pretrained` loads the folder alone.

MoE adapters (peft's LoRA on the stacked experts and the router, `adapters.py`) give each
expert e the update `scale B_e A_e`; it goes into whichever names the base stores: the
stacked `mlp.experts.gate_up_proj` / `down_proj`, or one tensor per expert as the family's
checkpoints name them (its `ExpertNames`: Mixtral `block_sparse_moe.experts.e.w1/w3/w2`, Qwen
`mlp.experts.e.gate_proj/up_proj/down_proj`): gate_up's first F rows to the gate, the rest to up.

A quantized base (gpt-oss's MXFP4 experts, DeepSeek-V3's FP8 weights) is merged as hfmeg reads it, dequantized
(`checkpoint/quantized.py`): every tensor is written in float (the base's declared dtype), the scales folded in,
the shard index renamed to match and the `quantization_config` dropped, as `hfmeg export` writes a converted
release. (Adding an update to the FP8 codes themselves would be wrong: their scales would not be redone.)

A QLoRA adapter (`cfg.quantize`) was trained on the 4-bit base, so it is merged into that base dequantized: each
weight the run held 4-bit is first quantized and dequantized by bitsandbytes (`rules_4bit.Dequantized4bit`: alone,
or an MoE layer's whole expert stack), as peft's `merge_and_unload` gives on the dequantized model, and written in the
base's dtype; a `*-bnb-4bit` base's stored 4-bit weights are only dequantized.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from ..checkpoint.atomic import atomic_output_dir, save_tensors
from ..checkpoint.hf_reader import SAFE_INDEX, HFCheckpoint
from ..checkpoint.hf_writer import write_config
from ..checkpoint.mp_layout import dtype_name
from ..checkpoint.load import source_config
from ..checkpoint.rules_4bit import Dequantized4bit
from ..config import load_hf_config
from ..errors import CheckpointError
from ..families import family_of
from ..families.llama import MLP
from ..families.spec import ExpertNames
from .adapters import PEFT_PREFIX
from .config import PeftConfig


def _expert_deltas(tensors: dict[str, torch.Tensor], cfg: PeftConfig, names: set[str],
                   disk: ExpertNames) -> dict[str, torch.Tensor]:
    """{base tensor name: its fp32 update} for the MoE experts' and router's adapters in `tensors`, named as the
    base (`names`: every tensor name in its files) stores them: stacked, or per expert as its family's
    checkpoints name them (`disk`)."""
    out = {}
    for key in [k for k in tensors if k.endswith(".lora_A.weight")]:
        module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        layer, _, rest = module.partition(".mlp.")
        if rest not in ("gate", "experts", "experts.base_layer"):
            continue
        a, b = tensors[key].float(), tensors[key.replace(".lora_A.", ".lora_B.")].float()
        per_expert = disk if f"{layer}.{disk.block}gate.weight" in names else MLP
        moe = f"{layer}.{per_expert.block}"
        if rest == "gate":
            out[moe + "gate.weight"] = (b @ a) * cfg.scale
            continue
        params = cfg.moe_targets()[1]
        param = "gate_up_proj" if rest.endswith("base_layer") or "down_proj" not in params else "down_proj"
        rank = cfg.param_rank(param)[0]
        experts = a.shape[0] // rank
        a = a.unflatten(0, (experts, rank))  # [E, r, in]
        b = b.unflatten(1, (rank, experts)).permute(2, 0, 1)  # [E, out, r]
        delta = (b @ a) * cfg.param_scale(param)  # [E, out, in]
        if f"{layer}.mlp.experts.{param}" in names:  # stored stacked, as transformers holds it
            out[f"{layer}.mlp.experts.{param}"] = delta
            continue
        for e in range(experts):
            p = f"{moe}experts.{e}."
            if param == "down_proj":
                out[p + per_expert.down + ".weight"] = delta[e]
            else:
                gate, up = delta[e].chunk(2, dim=0)
                out[p + per_expert.gate + ".weight"] = gate
                out[p + per_expert.up + ".weight"] = up
    return out


def _merged(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, magnitude: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """`W + scale B A`; with DoRA's `magnitude` m, that times m / (its row norms)."""
    full = w.float() + (b @ a) * scale
    if magnitude is not None:
        full = full * (magnitude.float() / torch.linalg.norm(full, dim=1)).unsqueeze(1)
    return full.to(w.dtype)


def _dequantized_side_files(quant: HFCheckpoint, folder: Path) -> None:
    """The config and shard index of a merged quantized base: no `quantization_config`, the float tensors' names."""
    write_config(quant.folder / "config.json", folder / "config.json", dtype_name(quant.quantized.declared))
    index = folder / SAFE_INDEX
    if index.is_file():
        found = json.loads(index.read_text())
        found["weight_map"] = {quant.quantized.float_name(k): v for k, v in found["weight_map"].items()
                               if quant.quantized.float_name(k) is not None}
        found.get("metadata", {}).pop("total_size", None)  # the float tensors' size differs; loading does not need it
        index.write_text(json.dumps(found, indent=2) + "\n")


def merge_into_hf(base: Path, tensors: dict[str, torch.Tensor], cfg: PeftConfig, out: Path, *,
                  overwrite: bool = True) -> Path:
    """Write `base` (an HF folder) with the PEFT `tensors` of an adapter with settings `cfg` merged in to `out`,
    atomically."""
    base = Path(base)
    merge = Merge(base, tensors, cfg)
    with atomic_output_dir(out, overwrite=overwrite, inputs=(base,)) as tmp:
        for path, meta, weights in merge.files():
            save_tensors(weights, tmp / path.name, meta)
        for path in sorted(base.iterdir()):
            if path.is_file() and path.suffix not in (".safetensors", ".bin"):
                shutil.copyfile(path, tmp / path.name)
        if merge.quant is not None:
            _dequantized_side_files(merge.quant, tmp)
    return Path(out)


class Merge:
    """The merged weights of `base` (an HF folder) with the PEFT `tensors` of an adapter with settings `cfg`, file
    by file (`files`), as `merge_into_hf` writes them; `adapted()` is only the tensors the adapter changes, what a
    weight push to a model that holds the rest already needs (train/rollout.py)."""

    def __init__(self, base: Path, tensors: dict[str, torch.Tensor], cfg: PeftConfig):
        self.base, self.tensors, self.cfg = Path(base), tensors, cfg
        names = set()
        for path in self.base.glob("*.safetensors"):
            with safe_open(str(path), "pt") as f:
                names.update(f.keys())
        disk = family_of(load_hf_config(self.base).model_type).experts or MLP
        self.deltas = _expert_deltas(tensors, cfg, names, disk)
        # modules trained in full (`modules_to_save`), under the base's names: peft's key is transformers v5's
        # module path, and a Mixtral file may store the router under v4's `block_sparse_moe.gate`
        self.saved = {}
        for k in tensors:
            if ".lora_" not in k:
                name = k.removeprefix(PEFT_PREFIX)
                v4 = name.replace(".mlp.gate.", f".{disk.block}gate.")
                self.saved[name if name in names or v4 not in names else v4] = k
        self.updates = {k.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight") + ".weight": k
                        for k in tensors if k.endswith(".lora_A.weight") and ".mlp.experts" not in k
                        and ".mlp.gate." not in k}
        source = HFCheckpoint(self.base)
        self.quant = source if source.quantized is not None else None  # a release read dequantized
        self.four_bit = (Dequantized4bit(source, source_config(source), cfg.quantize, cfg.double_quant)
                         if cfg.quantize else ())

    def files(self, adapted_only: bool = False) -> Iterator[tuple[Path, dict | None, dict[str, torch.Tensor]]]:
        """(base file, its metadata, {name: merged tensor}) per safetensors file of the base, every tensor of it
        (`adapted_only`: those the adapter changes); refuses an adapter whose base weight is not there."""
        changed = set(self.updates) | set(self.saved) | set(self.deltas)
        quant, merged = self.quant, set()
        for path in sorted(self.base.glob("*.safetensors")):
            weights = {}
            with safe_open(str(path), "pt") as f:
                meta = f.metadata()
                for stored in f.keys():
                    name = stored if quant is None else quant.quantized.float_name(stored)
                    if name is None or (adapted_only and name not in changed):
                        continue  # a scale, folded into its tensor; or a tensor the adapter leaves as it is
                    if quant is not None and name in quant.quantized.pairs:
                        w = quant.get(name).to(quant.dtype(name))
                    else:
                        w = f.get_tensor(stored)
                    if name in self.four_bit:  # the base a QLoRA adapter was trained on
                        w = self.four_bit.get(name, w)
                    weights[name] = self._merged(name, w)
                    merged.update({name} & changed)
            yield path, meta, weights
        missing = sorted(changed - merged)
        if missing:
            raise CheckpointError(f"{self.base}: no base weight {missing[0]} for its adapter (the adapter was "
                                  "trained on another model)")

    def adapted(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, merged tensor) of every tensor the adapter changes."""
        for _, _, weights in self.files(adapted_only=True):
            yield from weights.items()

    def _merged(self, name: str, w: torch.Tensor) -> torch.Tensor:
        tensors = self.tensors
        if name in self.deltas:
            return (w.float() + self.deltas[name]).to(w.dtype)
        if name in self.saved:  # a module trained in full (modules_to_save)
            return tensors[self.saved[name]].to(w.dtype)
        if name in self.updates:
            key = self.updates[name]
            a, b = tensors[key].float(), tensors[key.replace(".lora_A.", ".lora_B.")].float()
            return _merged(w, a, b, tensors.get(key.replace(".lora_A.weight", ".lora_magnitude_vector")),
                           self.cfg.scale)
        return w
