"""Adapters on disk: each rank's shard in a training checkpoint, and PEFT's adapter folder.

Shards. In a LoRA run's training checkpoint every model-parallel rank with DP rank 0
writes `mp_rank_TT[_PPP]/adapter.safetensors`: its adapter tensors under the chunks'
parameter names. The file's metadata says, for each tensor, its PEFT key and split
kind (`adapters.AdapterTensor`) and the writer's TP rank, so `assemble` rebuilds the
full PEFT tensors from the files alone, with no model built. The base weights are not
written (they are frozen): the checkpoint's trainer state references them instead
(`base_fingerprint`).

PEFT folder. `adapter_config.json` (the fields `peft.LoraConfig` reads) plus
`adapter_model.safetensors` keyed `base_model.model.<module>.lora_A.weight` /
`lora_B.weight` (/ `lora_magnitude_vector` for DoRA), which `peft.PeftModel.from_pretrained(base, folder)` loads.
`read_peft_folder` accepts a LoRA or DoRA one that `peft` itself wrote and says in one
line what does not fit.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..checkpoint.atomic import atomic_output_dir
from ..checkpoint.hub_ids import portable_name
from ..errors import CheckpointError, UnsupportedConfigError
from ..models.decoder import ModelChunk
from ..parallel.params_ready import wait_params_ready
from ..parallel.state import ParallelState
from ..parallel.stored_names import stored_tensors
from .adapters import adapter_tensors, join_slices
from .config import EXPERT_PARAMS, LLAMA_PROJECTIONS, QWEN2_MOE_TARGETS, PeftConfig

SHARD_FILE = "adapter.safetensors"
EXPERT_SHARD_FILE = "adapter-experts-{first:03d}-{last:03d}.safetensors"  # an EP rank's experts first..last
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def write_adapter_shard(chunks: list[ModelChunk], ps: ParallelState, rank_dir: Path) -> None:
    """This rank's adapter tensors into `rank_dir/adapter.safetensors` (DP rank 0 only: replicas are equal).

    With expert parallelism the other ranks of DP rank 0's EP group hold other experts: each writes only its
    experts' adapters (role `expert`) into `adapter-experts-EEE-FFF.safetensors`, as `mp_save` does for models;
    every tensor is under its stored name, so each expert is in the folder once whatever the EP size."""
    ep_rank = getattr(ps, "ep_rank", 0)
    if getattr(ps, "edp_rank", ps.dp_rank) != 0 or ps.dp_rank != ep_rank:
        return
    wait_params_ready(chunks)  # the overlapped optimizer's all-gathers may still be in flight
    tensors, table = {}, {}
    for chunk in chunks:
        params = stored_tensors(chunk)
        for t in adapter_tensors(chunk):
            if ep_rank == 0 or t.expert is not None:
                tensors[t.local] = params[t.local].detach().contiguous().cpu()
                table[t.local] = [t.hf, t.kind, t.vocab, t.expert]
    rank_dir.mkdir(parents=True, exist_ok=True)
    mine = chunks[0].experts
    name = SHARD_FILE if ep_rank == 0 else EXPERT_SHARD_FILE.format(first=mine[0], last=mine[-1])
    save_file(tensors, str(rank_dir / name),
              metadata={"format": "pt", "tp_rank": str(ps.tp_rank), "tensors": json.dumps(table)})


def _shard_files(rank_dir: Path) -> list[Path]:
    return sorted(rank_dir.glob("adapter*.safetensors"))


def read_adapter_shard(chunks: list[ModelChunk], rank_dir: Path) -> None:
    """Copy this rank's adapter tensors back from `rank_dir`'s adapter files (found by stored name, so the
    experts may have been written at another EP size)."""
    path = rank_dir / SHARD_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; the checkpoint holds no adapters for this rank")
    saved = {}
    for f in _shard_files(rank_dir):
        saved.update(load_file(str(f)))
    with torch.no_grad():
        for chunk in chunks:
            params = stored_tensors(chunk)
            for t in adapter_tensors(chunk):
                if t.local not in saved or saved[t.local].shape != params[t.local].shape:
                    raise CheckpointError(f"{path}: tensor {t.local} missing or of another shape; the checkpoint "
                                          "was saved with other peft.* settings")
                params[t.local].copy_(saved[t.local])


def assemble(iter_dir: Path, value=None) -> dict[str, torch.Tensor]:
    """The full PEFT tensors (key -> tensor) from every rank's shard under `iter_dir`.

    `value(rank_dir, local, saved)`: what to join in place of each saved tensor (one shaped like it,
    e.g. its optimizer state when a checkpoint is resharded)."""
    slices: dict[str, dict[int, torch.Tensor]] = {}
    kinds: dict[str, tuple[str, int | None]] = {}
    if not sorted(iter_dir.glob(f"mp_rank_*/{SHARD_FILE}")):
        raise CheckpointError(f"{iter_dir}: no mp_rank_*/{SHARD_FILE}; not a LoRA training checkpoint")
    for path in sorted(iter_dir.glob("mp_rank_*/adapter*.safetensors")):
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            tp_rank = int(meta["tp_rank"])
            for local, (hf, kind, vocab, *expert) in json.loads(meta["tensors"]).items():
                saved = f.get_tensor(local)
                # TP slices are joined by TP rank, expert pieces by expert index
                index = expert[0][0] if expert and expert[0] is not None else tp_rank
                slices.setdefault(hf, {})[index] = saved if value is None else value(path.parent, local, saved)
                kinds[hf] = kind, vocab
    return {hf: join_slices([by_rank[r] for r in sorted(by_rank)], *kinds[hf]) for hf, by_rank in slices.items()}


def adapter_config(cfg: PeftConfig, base: str, targets: list[str], params: list[str] = ()) -> dict:
    """`adapter_config.json` for `cfg` (the fields `peft.LoraConfig` reads). `params`: the MoE expert/router
    parameters adapted (`target_parameters`, gate_up_proj at rank 2r as peft's conversion of w1 + w3 sets it)."""
    out = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": cfg.r,
           "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "target_modules": targets, "bias": "none",
           "use_rslora": cfg.use_rslora, "use_dora": cfg.method == "dora",
           "modules_to_save": cfg.modules_to_save or None,
           "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True}
    if params:
        r, alpha = cfg.param_rank("gate_up_proj")
        out.update(target_modules=targets or None, target_parameters=list(params),
                   rank_pattern={GATE_UP_PATTERN: r} if "gate_up_proj" in params else {},
                   alpha_pattern={GATE_UP_PATTERN: alpha} if "gate_up_proj" in params else {})
    return out


GATE_UP_PATTERN = r".*\.gate_up_proj"  # peft's rank/alpha pattern key for the fused experts


def write_peft_folder(out: Path, tensors: dict[str, torch.Tensor], cfg: PeftConfig, base: str, *,
                      overwrite: bool = True) -> Path:
    """Write a PEFT adapter folder atomically; `base` is the Hub id or folder of the base model.

    The folder names its base as any working directory finds it (`portable_name`: the Hub id, also of a
    folder in the HF cache, else the absolute path), so `AutoPeftModelForCausalLM` loads it from anywhere."""
    # the projection of each A (a DoRA magnitude's key is one part shorter: `...q_proj.lora_magnitude_vector`)
    targets = sorted({k.split(".")[-3] for k in tensors if k.endswith(".lora_A.weight")} & set(QWEN2_MOE_TARGETS))
    moe = any(".mlp.experts." in k or ".mlp.gate.lora_" in k for k in tensors)  # not a router in modules_to_save
    params = cfg.moe_targets()[1] if moe else ()
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(adapter_config(cfg, portable_name(base), targets, params), indent=2) + "\n")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    return Path(out)
def read_peft_folder(folder: Path) -> tuple[PeftConfig, dict[str, torch.Tensor]]:
    """A PEFT LoRA adapter folder's settings and tensors (PEFT keys), checked."""
    folder = Path(folder)
    path = folder / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e}); peft.init_from must name a PEFT adapter folder") from e
    if raw.get("peft_type") != "LORA":
        raise UnsupportedConfigError(f"{path}: peft_type {raw.get('peft_type')!r}; only LORA adapters are read")
    if raw.get("bias", "none") != "none" or raw.get("fan_in_fan_out"):
        raise UnsupportedConfigError(f"{path}: bias {raw.get('bias')!r} / fan_in_fan_out are not supported")
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{weights}: missing (a PEFT adapter folder holds {WEIGHTS_FILE})")
    # peft may list targets as full module paths; the projections the tensors adapt are what counts
    # (`initialise` refuses an adapter that leaves some layers' projections out).
    with safe_open(str(weights), "pt") as f:
        targets = sorted({k.split(".")[-3] for k in f.keys() if k.endswith(".lora_A.weight")})
    if raw.get("target_parameters"):  # an MoE adapter: LoRA on the stacked experts / the router
        targets = sorted(set(targets) & set(LLAMA_PROJECTIONS)) + _expert_params(raw, path)
    cfg = PeftConfig(method="dora" if raw.get("use_dora") else "lora", r=int(raw["r"]), alpha=float(raw["lora_alpha"]),
                     dropout=float(raw.get("lora_dropout", 0.0)), target_modules=targets,
                     use_rslora=bool(raw.get("use_rslora", False)),
                     modules_to_save=list(raw.get("modules_to_save") or []))
    cfg.check()
    return cfg, load_file(str(weights))


def _expert_params(raw: dict, path: Path) -> list[str]:
    """The `EXPERT_PARAMS` a peft config's `target_parameters` name, checked: gate_up_proj must have peft's
    rank/alpha for w1 + w3 (2r, 2 alpha), the only fused LoRA hfmeg builds."""
    params = {t.rpartition("experts.")[2] for t in raw["target_parameters"]}
    other = sorted(params - set(EXPERT_PARAMS))
    if other:
        raise UnsupportedConfigError(f"{path}: target_parameters {other} are not MoE experts/router parameters "
                                     f"hfmeg adapts ({list(EXPERT_PARAMS)})")
    if "gate_up_proj" in params:
        r, alpha = int(raw["r"]), float(raw["lora_alpha"])
        rank = [v for k, v in (raw.get("rank_pattern") or {}).items() if k.endswith("gate_up_proj")]
        alphas = [float(v) for k, v in (raw.get("alpha_pattern") or {}).items() if k.endswith("gate_up_proj")]
        if rank != [2 * r] or alphas != [2 * alpha]:
            raise UnsupportedConfigError(f"{path}: gate_up_proj has rank {rank or r}, alpha {alphas or alpha}; hfmeg "
                                         "reads peft's fused w1 + w3 (gate_proj + up_proj) LoRA: rank 2r, alpha 2 alpha")
    return [p for p in EXPERT_PARAMS if p in params]


def base_fingerprint(folder: Path) -> str:
    """sha256 over the base model's weight files (names and bytes): what a LoRA checkpoint was trained on."""
    h = hashlib.sha256()
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weights to fingerprint")
    for path in files:
        h.update(path.name.encode())
        with open(path, "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
    return h.hexdigest()
