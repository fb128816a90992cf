"""Adapters on disk: each rank's shard in a training checkpoint, and PEFT's adapter folder.

Shards. In a LoRA run's training checkpoint every model-parallel rank with DP rank 0
writes `mp_rank_TT[_PPP]/adapter.safetensors`: its adapter tensors under the chunks'
parameter names. The file's metadata says, for each tensor, its PEFT key and split
kind (`adapters.AdapterTensor`) and the writer's TP rank, so `assemble` rebuilds the
full PEFT tensors from the files alone, with no model built. The base weights are not
written (they are frozen): the checkpoint's trainer state references them instead
(`base_fingerprint`).

Every read is checked first, so damage is one line naming the file (`CheckpointError`), never a
traceback or a half-width adapter: `check_adapter_shards` (the converters, `reshard_mp.py`, the export)
holds a checkpoint to its layout (no rank folder the layout lacks, every rank's shard present, headers
readable, written by that TP rank, exactly the tensors and shapes that rank's chunks, built on the meta
device, carry); `read_adapter_shard` (a resuming rank) holds its own shard to its live chunks.

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
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from ..checkpoint.atomic import atomic_output_dir, save_tensors
from ..checkpoint.convert import load_model_config
from ..checkpoint.placement import as_saved
from ..checkpoint.hub_ids import portable_name
from ..checkpoint.mp_layout import HF_DIR, MPLayout
from ..errors import CheckpointError, UnsupportedConfigError
from ..models.decoder import ModelChunk
from ..parallel.gather_named import gather_named
from ..parallel.params_ready import wait_params_ready
from ..parallel.splits import from_record
from ..parallel.grid import RankPlace
from ..parallel.stored_names import stored_tensors
from .adapters import adapter_tensors, attach
from .config import EXPERT_PARAMS, MODULES, PeftConfig

SHARD_FILE = "adapter.safetensors"
EXPERT_SHARD_FILE = "adapter-experts-{first:03d}-{last:03d}.safetensors"  # an EP rank's experts first..last
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def write_adapter_shard(chunks: list[ModelChunk], ps: RankPlace, rank_dir: Path) -> None:
    """This rank's adapter tensors into `rank_dir/adapter.safetensors` (DP rank 0 only: replicas are equal).

    With expert parallelism the other ranks of DP rank 0's EP group hold other experts: each writes only its
    experts' adapters (role `expert`) into `adapter-experts-EEE-FFF.safetensors`, as `mp_save` does for models;
    every tensor is under its stored name, so each expert is in the folder once whatever the EP size."""
    shard = _shard(chunks, ps)
    if shard is None:
        return
    tensors, table = shard
    rank_dir.mkdir(parents=True, exist_ok=True)
    mine = chunks[0].experts
    name = SHARD_FILE if ps.ep_rank == 0 else EXPERT_SHARD_FILE.format(first=mine[0], last=mine[-1])
    save_tensors({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, rank_dir / name,
                 {"format": "pt", "tp_rank": str(ps.tp_rank), "tensors": json.dumps(table)})


def _shard(chunks: list[ModelChunk], ps: RankPlace) -> tuple[dict[str, torch.Tensor], dict[str, list]] | None:
    """What this rank's adapter shard holds (`write_adapter_shard`): its live adapter tensors by stored name, and
    the table of each one's PEFT key, split kind and expert; None where it writes none."""
    ep_rank = ps.ep_rank
    if ps.edp_rank != 0 or ps.dp_rank != ep_rank:
        return None
    wait_params_ready(chunks)  # the overlapped optimizer's all-gathers may still be in flight
    tensors, table = {}, {}
    for chunk in chunks:
        params = stored_tensors(chunk)
        for t in adapter_tensors(chunk):
            if ep_rank == 0 or t.expert is not None:
                tensors[t.local] = params[t.local]
                kind, vocab, blocks = t.split.record(ps.tp)
                table[t.local] = [t.hf, kind, vocab, t.expert] + ([blocks] if blocks else [])
    return tensors, table


def live_adapters(chunks: list[ModelChunk], ps) -> dict[str, torch.Tensor] | None:
    """Collective: the full PEFT tensors of the chunks' live adapters on rank 0 (None elsewhere), joined from every
    rank's shard as `assemble` joins the files, with no file written (a weight push, `parallel.gather_named`)."""
    shard = _shard(chunks, ps)
    tensors, meta = (shard[0], (ps.tp_rank, shard[1])) if shard is not None else ({}, None)
    gathered = gather_named(list(tensors.items()), meta, ps.device)
    if gathered is None:
        return None
    return _join((tp_rank, table, tensors) for (tp_rank, table), tensors in gathered)


def _shard_files(rank_dir: Path) -> list[Path]:
    return sorted(rank_dir.glob("adapter*.safetensors"))


def _shard_headers(rank_dir: Path, tp_rank: int) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Stored name -> (file, shape) over the adapter files of one rank folder, from their headers alone: refuses
    a missing `adapter.safetensors`, an unreadable or truncated file, one that is not an hfmeg adapter shard, one
    written by another TP rank, and a tensor in two files."""
    if not (rank_dir / SHARD_FILE).is_file():
        raise CheckpointError(f"{rank_dir / SHARD_FILE}: missing; the layout has this rank, and its adapters are "
                              "in no other file")
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in _shard_files(rank_dir):
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            table, writer = json.loads(meta["tensors"]), int(meta["tp_rank"])
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: cannot read the adapter shard, truncated or not safetensors "
                                  f"({type(e).__name__}: {e})") from e
        except (KeyError, ValueError, TypeError):
            raise CheckpointError(f"{path}: not an hfmeg adapter shard (its metadata lacks the tensors table or "
                                  "the TP rank)") from None
        if writer != tp_rank:
            raise CheckpointError(f"{path}: written by TP rank {writer}, but it is in TP rank {tp_rank}'s folder")
        if set(table) != set(shapes):
            raise CheckpointError(f"{path}: its metadata does not list the tensors it holds")
        for name, shape in shapes.items():
            if name in found:
                raise CheckpointError(f"{path}: tensor {name} is also in {found[name][0].name}")
            found[name] = path, shape
    return found


def _check_tensors(rank_dir: Path, want: dict[str, tuple[int, ...]],
                   found: dict[str, tuple[Path, tuple[int, ...]]], exact: bool) -> None:
    """The rank's adapter files hold every tensor of `want` with its shape (and, `exact`, nothing else)."""
    lacks, extra = sorted(set(want) - set(found)), sorted(set(found) - set(want)) if exact else []
    if lacks or extra:
        what = f"lacks tensor(s) {', '.join(lacks[:3])}" if lacks else f"has unexpected tensor(s) {', '.join(extra[:3])}"
        raise CheckpointError(f"{rank_dir}: {what}; the checkpoint was saved with other peft.* settings or "
                              "another model")
    for name, shape in want.items():
        path, got = found[name]
        if got != tuple(shape):
            raise CheckpointError(f"{path}: tensor {name} has shape {list(got)}, the layout implies {list(shape)}")


def _load(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: cannot read the adapter shard ({type(e).__name__}: {e})") from e


def read_adapter_shard(chunks: list[ModelChunk], rank_dir: Path, tp_rank: int) -> None:
    """Copy this rank's adapter tensors back from `rank_dir`'s adapter files (found by stored name, so the
    experts may have been written at another EP size), every file's header and every shape checked first."""
    found = _shard_headers(rank_dir, tp_rank)
    want = {}
    for chunk in chunks:
        params = stored_tensors(chunk)
        want.update({t.local: tuple(params[t.local].shape) for t in adapter_tensors(chunk)})
    _check_tensors(rank_dir, want, found, exact=False)  # an EP rank holds only its own experts
    saved = {}
    for path in sorted({found[name][0] for name in want}):
        saved.update(_load(path))
    with torch.no_grad():
        for chunk in chunks:
            params = stored_tensors(chunk)
            for t in adapter_tensors(chunk):
                params[t.local].copy_(saved[t.local])


def meta_rank_chunks(model_cfg, layout: MPLayout, cfg: PeftConfig) -> Iterator[tuple[RankPlace, list[ModelChunk]]]:
    """For every rank (TP fastest) of `layout`: its place in the grid and its chunks on the meta device with
    their adapters attached (what the trainer would build there, no memory held)."""
    grid = layout.grid
    for ps in map(grid.place, range(grid.world_size)):
        chunks = []
        for spec in layout.rank_chunks(ps.pp_rank):
            with torch.device("meta"):
                chunk = ModelChunk(model_cfg, ps, spec.layers, pre_process=spec.pre_process,
                                   post_process=spec.post_process, vocab_multiple=layout.vocab_multiple)
                attach(chunk, cfg)
            chunks.append(chunk)
        yield ps, chunks


def check_adapter_shards(iter_dir: Path, cfg: PeftConfig) -> MPLayout:
    """Check a LoRA checkpoint's shards against its layout before anything reads them: only the layout's rank
    folders, each with its adapter file, headers readable, written by that TP rank, holding exactly the
    tensors and shapes the layout and `cfg` (its `peft.*` settings) imply. Returns the layout."""
    layout = MPLayout.read(iter_dir)
    layout.check_rank_dirs(iter_dir)
    model_cfg = as_saved(load_model_config(iter_dir / HF_DIR), layout.model_config)
    for ps, chunks in meta_rank_chunks(model_cfg, layout, cfg):
        rank_dir = iter_dir / layout.rank_dir(ps.tp_rank, ps.pp_rank)
        want = {}
        for chunk in chunks:
            params = stored_tensors(chunk)
            want.update({t.local: tuple(params[t.local].shape) for t in adapter_tensors(chunk)})
        _check_tensors(rank_dir, want, _shard_headers(rank_dir, ps.tp_rank), exact=True)
    return layout


def assemble(iter_dir: Path, value=None) -> dict[str, torch.Tensor]:
    """The full PEFT tensors (key -> tensor) from every rank's shard under `iter_dir` (a checkpoint's shards are
    checked against its layout first, `check_adapter_shards`).

    `value(rank_dir, local, saved)`: what to join in place of each saved tensor (one shaped like it,
    e.g. its optimizer state when a checkpoint is resharded)."""
    if not sorted(iter_dir.glob(f"mp_rank_*/{SHARD_FILE}")):
        raise CheckpointError(f"{iter_dir}: no mp_rank_*/{SHARD_FILE}; not a LoRA training checkpoint")

    def shards():
        for path in sorted(iter_dir.glob("mp_rank_*/adapter*.safetensors")):
            with safe_open(str(path), "pt") as f:
                meta = f.metadata()
            tensors = _load(path)
            if value is not None:
                tensors = {local: value(path.parent, local, saved) for local, saved in tensors.items()}
            yield int(meta["tp_rank"]), json.loads(meta["tensors"]), tensors

    return _join(shards())


def _join(shards) -> dict[str, torch.Tensor]:
    """The full PEFT tensors from shards given as (TP rank, table, {stored name: tensor}) (`_shard`'s table)."""
    slices: dict[str, dict[int, torch.Tensor]] = {}
    kinds: dict[str, tuple] = {}
    for tp_rank, table, tensors in shards:
        for local, (hf, kind, vocab, *rest) in table.items():
            expert, blocks = (rest + [None, None])[:2]  # written later: absent from older shards
            # TP slices are joined by TP rank, expert pieces by expert index
            index = expert[0] if expert is not None else tp_rank
            slices.setdefault(hf, {})[index] = tensors[local]
            kinds[hf] = from_record(kind, vocab, blocks)
    return {hf: kinds[hf].join([by_rank[r] for r in sorted(by_rank)]) for hf, by_rank in slices.items()}


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
    targets = sorted({k.split(".")[-3] for k in tensors if k.endswith(".lora_A.weight")} & set(MODULES))
    moe = any(".mlp.experts." in k or ".mlp.gate.lora_" in k for k in tensors)  # not a router in modules_to_save
    params = cfg.moe_targets()[1] if moe else ()
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        config = adapter_config(cfg, portable_name(base), targets, params)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_tensors({k: v.contiguous() for k, v in tensors.items()}, tmp / WEIGHTS_FILE, {"format": "pt"})
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
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{weights}: cannot read the adapter weights, truncated or not safetensors "
                              f"({type(e).__name__}: {e})") from e
    targets = sorted({k.split(".")[-3] for k in tensors if k.endswith(".lora_A.weight")})
    if raw.get("target_parameters"):  # an MoE adapter: LoRA on the stacked experts / the router
        targets = sorted(set(targets) & set(MODULES)) + _expert_params(raw, path)
    cfg = PeftConfig(method="dora" if raw.get("use_dora") else "lora", r=int(raw["r"]), alpha=float(raw["lora_alpha"]),
                     dropout=float(raw.get("lora_dropout", 0.0)), target_modules=targets,
                     use_rslora=bool(raw.get("use_rslora", False)),
                     modules_to_save=list(raw.get("modules_to_save") or []))
    cfg.check()
    return cfg, tensors


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
