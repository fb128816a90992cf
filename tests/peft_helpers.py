"""What the LoRA tests share: a tiny base with a `peft`-made adapter, and hfmeg chunks carrying it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from tiny_models import reference_attention, save_tiny
from transformers import AutoModelForCausalLM

from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.data.microbatch import MicroBatch
from hfmeg.parallel.data_parallel import DataParallel
from hfmeg.parallel.pipeline import forward_backward
from hfmeg.checkpoint.load import load_chunks
from hfmeg.peft.adapter_files import read_peft_folder
from hfmeg.peft.merge import merge_into_hf
from hfmeg.parallel.stored_names import stored_tensors
from hfmeg.peft.adapters import adapter_tensors, attach, initialise


def make_base_and_adapter(root: Path, kind: str = "llama3", *, rslora: bool = False, dora: bool = False,
                          targets="all-linear", modules_to_save: list[str] | None = None,
                          seed: int = 0) -> tuple[Path, Path]:
    """A tiny random base (transformers' save_pretrained) and a `peft_adapter` for it."""
    base = root / f"{kind}_base"
    if not base.is_dir():
        save_tiny(kind, base, seed=seed)
    tags = (("_rs", rslora), ("_dora", dora), ("_save", modules_to_save))
    adapter = root / f"{kind}_adapter{''.join(tag for tag, on in tags if on)}"
    return base, peft_adapter(base, adapter, rslora=rslora, dora=dora, targets=targets,
                              modules_to_save=modules_to_save, seed=seed)


def peft_adapter(base: Path, adapter: Path, *, rslora: bool = False, dora: bool = False, targets="all-linear",
                 modules_to_save: list[str] | None = None, seed: int = 0) -> Path:
    """A LoRA (or DoRA) adapter `peft` made for `base` with `init_lora_weights=False`: A and B both random, so every
    adapter gradient is non-zero. DoRA's magnitudes, and the weights of `modules_to_save` (which peft saves as copies
    of the base's), are then scaled by random factors in [0.5, 1.5), so that they differ from what they start at and
    their loading is tested too."""
    torch.manual_seed(seed + 1)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, use_rslora=rslora,
                     use_dora=dora, init_lora_weights=False, task_type="CAUSAL_LM", modules_to_save=modules_to_save)
    get_peft_model(model, cfg).save_pretrained(adapter)
    if dora or modules_to_save:
        path = adapter / "adapter_model.safetensors"
        tensors = load_file(str(path))
        g = torch.Generator().manual_seed(seed + 2)
        for k, v in tensors.items():
            if k.endswith("lora_magnitude_vector") or ".lora_" not in k:
                tensors[k] = v * (0.5 + torch.rand(v.shape, generator=g))
        save_file(tensors, str(path), metadata={"format": "pt"})
    return adapter


def peft_reference(base: Path, adapter: Path, trainable: bool = True, dtype: torch.dtype = torch.float32):
    """peft's `adapter` on `base`, in fp32 or (`dtype`) converted to float64 after loading, with the experts' eager
    loop there (the same arithmetic as transformers' grouped GEMM, which has no float64 kernel)."""
    load = {} if dtype == torch.float32 else {"experts_implementation": "eager"}
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation=reference_attention(base),
                                                 **load)
    return PeftModel.from_pretrained(model, adapter, is_trainable=trainable).to(dtype)


def peft_adapter_grads(model) -> dict[str, torch.Tensor]:
    """The reference's adapter gradients under PEFT's file keys (adapter name dropped)."""
    names = {".default": "", "lora_magnitude_vector.weight": "lora_magnitude_vector", ".modules_to_save": ""}
    out = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            for old, new in names.items():
                n = n.replace(old, new)
            out[n] = p.grad
    return out


def hfmeg_chunks(base: Path, adapter: Path, ps, dropout: float = 0.0, **options):
    """This rank's chunks of `base` with the adapter `peft` wrote in `adapter` on them."""
    cfg, tensors = read_peft_folder(adapter)
    cfg = replace(cfg, dropout=dropout)
    chunks = load_chunks(HFCheckpoint(base), ps, **options)
    for chunk in chunks:
        attach(chunk, cfg)
        initialise(chunk, cfg, seed=0, hf_tensors=tensors)
    return chunks, cfg


def full_adapter_grads(chunks, ps, of=lambda p: p.grad) -> dict[str, torch.Tensor]:
    """This rank's stage's adapter gradients (`of(parameter)`, e.g. its `main_grad`) as full PEFT-keyed tensors:
    TP slices gathered over TP, expert pieces over the EP group, joined as the export joins them."""
    out, experts, dense = {}, {}, []
    for chunk in chunks:
        grads = stored_tensors(chunk, of)
        for t in adapter_tensors(chunk):
            g = grads[t.local].contiguous()
            if t.expert is not None:
                experts.setdefault(t.hf, (t.split, {}))[1][t.expert[0]] = g
                continue
            dense.append((t, g))
    if dense:  # one all-gather of every TP slice, flattened (one collective, not one per tensor)
        flat = torch.cat([g.reshape(-1) for _, g in dense])
        every = [torch.empty_like(flat) for _ in range(ps.tp)] if ps.tp > 1 else [flat]
        if ps.tp > 1:
            dist.all_gather(every, flat, group=ps.tp_group)
        start = 0
        for t, g in dense:
            out[t.hf] = t.split.join([part[start:start + g.numel()].view_as(g).to(g.dtype) for part in every])
            start += g.numel()
    if getattr(ps, "ep", 1) > 1:
        every = [None] * ps.ep
        dist.all_gather_object(every, experts, group=ps.ep_group)
        experts = {hf: (kind, {e: g for rank in every for e, g in rank[hf][1].items()}) for hf, (kind, _) in
                   experts.items()}
    for hf, (split, pieces) in experts.items():
        out[hf] = split.join([pieces[e] for e in sorted(pieces)])
    return out


def replica_step(chunks, ps, ids, labels) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward and backward of the same rows on every DP replica: (this replica's share of the loss, 1/dp of it;
    the full adapter gradients as PEFT-keyed tensors, which the DP wrapper summed: experts over expert-DP, partial
    ones over TP)."""
    wrapper = DataParallel(chunks, ps, "ddp", bucket_size=2**20)
    loss = forward_backward(chunks, ps, [MicroBatch(input_ids=ids, labels=labels)], schedule="1f1b",
                            num_tokens=int((labels != -100).sum()) * ps.dp, grad_sync=wrapper)
    wrapper.finish_grad_sync()
    return loss, full_adapter_grads(chunks, ps, lambda p: getattr(p, "main_grad", p))


def peft_logit_bound(base: Path, adapter: Path, ids: torch.Tensor, ref32: torch.Tensor) -> float:
    """How far an fp32 run's logits of `ids` (hfmeg's, or the merged export's) may be from peft's fp32 ones with
    `adapter` on `base`, `ref32`, by rounding alone: bounds.rounding_bound against the same peft model run in
    float64 (two fp32 runs compared)."""
    from bounds import rounding_bound

    with torch.no_grad():
        ref64 = peft_reference(base, adapter, trainable=False, dtype=torch.float64)(ids).logits
    return rounding_bound(ref32, ref64, runs=2)


def merged_vs_peft(base: Path, adapter: Path, out: Path) -> tuple[float, float]:
    """(max |logits| difference, its bound `peft_logit_bound`) between the folder `merge_into_hf` writes from
    `adapter` (loaded alone by transformers) and peft's adapter on `base`, on one fixed batch."""
    cfg, tensors = read_peft_folder(adapter)
    merged = merge_into_hf(base, tensors, cfg, out)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = peft_reference(base, adapter, trainable=False)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(ids).logits
    return (got - want).abs().max().item(), peft_logit_bound(base, adapter, ids, want)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (the tests' gradient measure)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
