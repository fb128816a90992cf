"""The one way to build a rank's model: its (virtual) chunks, filled from a weight source.

A source is an HF checkpoint folder (`HFCheckpoint`), HF-named tensors in memory
(`TensorSource`), or an MP checkpoint (`MPCheckpoint`). Whatever the source, the
rank builds the `ModelChunk`s its pipeline rank holds, one per virtual stage in
virtual order (chunk v is model chunk v * pp + pp_rank), and fills every parameter
through the conversion rules (`checkpoint.rules`):

- HF-named sources are read one tensor at a time and sliced to this TP rank
  (`rules.to_local`). Shapes are checked against the config first, so a mismatched
  checkpoint fails with the tensor name instead of a reshape error deep inside torch.
  With tied embeddings the last stage's `lm_head` is filled from the embedding tensor
  by the rules, so both copies start equal.
- An MP checkpoint already holds each rank's slices under the chunks' own parameter
  names: the rank opens only its own rank folder and copies. Its layout (TP/PP/VPP and
  the layer split) must be the run's; another one is refused with a LayoutError that
  says how to reshard. The EP size is not part of it: every rank folder holds all
  experts by global index, and an expert-parallel rank reads only its own
  (`ModelChunk.experts`).

Chunks are created directly on `ps.device` and cast to `dtype` before they are filled: at 7B-layer sizes,
initialising billions of parameters on the CPU (only to overwrite them) takes minutes.

`base_4bit` (QLoRA): every TP linear of the decoder layers is stored 4-bit instead, as transformers'
`BitsAndBytesConfig(load_in_4bit=True)` stores each `nn.Linear` but the LM head. Its HF tensors, read one rule at a
time, are quantized whole by bitsandbytes and cut for the rank (`rules_4bit.to_local_4bit`); the codes go into a
`Frozen4bitWeight` provider on the layer (`parallel/layers.py`). The layer's full-precision parameter is dropped
right after the chunk is built, before the cast and before anything writes it: on the CPU its pages were never
touched, so a rank's resident memory is its 4-bit base, the other parameters and one rule's HF tensors at a time.
(On a GPU the allocator did hold it until then: building the chunk on the meta device would avoid that, but RoPE
computes its frequencies when built.) An MoE layer's routed experts are stored 4-bit too, one provider per stacked
weight (`GroupedExperts.fc1_provider`), each quantized whole from every expert's HF tensors and cut over EP
(`rules_4bit.experts_4bit`); its router stays full precision, as transformers leaves it. A `*-bnb-4bit` source's
linears are read as the codes it stores (`HFCheckpoint.packed_4bit`), cut for the rank without a dequantize /
requantize round; its quant type and double quantization must be the run's.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..config import VOCAB_MULTIPLE, ModelConfig, load_hf_config
from ..families import model_config_from_hf
from ..errors import CheckpointError, LayoutError
from ..quant.nf4 import quantize
from ..quant.qlora import Base4bit, Frozen4bitWeight
from ..families.spec import TensorRule
from ..models.decoder import ModelChunk
from ..errors import UnsupportedConfigError
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..parallel.layout import ChunkSpec, rank_chunks, split_layers
from ..parallel.state import ParallelState
from ..parallel.stored_names import stored_tensors
from .hf_reader import HFCheckpoint
from .mp_layout import DTYPES, MPLayout
from .mp_reader import MPCheckpoint
from .placement import as_stored, check_placed
from .rules import chunk_rules, expected_hf_shape, rule_tensors, to_local
from .rules_4bit import expert_stack, experts_4bit, stack_rules, stored_4bit, stored_packed, to_local_4bit
from .tensor_source import TensorSource

WeightSource = HFCheckpoint | TensorSource | MPCheckpoint


def load_chunks(
    source: WeightSource,
    ps: ParallelState,
    *,
    pp_layers: list[int] | None = None,
    dtype: torch.dtype | None = None,
    vocab_multiple: int = VOCAB_MULTIPLE,
    base_4bit: Base4bit | None = None,
    **options,
) -> list[ModelChunk]:
    """This rank's chunks of `source` for the layout `ps`, on `ps.device` in `dtype`.

    For HF-named sources `pp_layers` (layers per model chunk) and `vocab_multiple` set
    the split and the vocabulary padding, and `dtype` defaults to float32; an MP
    checkpoint brings its own split and padding, and its own dtype (float32 when mixed).
    `options` go to `ModelChunk` (recompute, ce_chunk_tokens, compile_backend). `base_4bit`: the TP linears
    stored 4-bit (module docstring), from an HF-named source only.
    """
    if isinstance(source, MPCheckpoint):
        if base_4bit is not None:
            raise UnsupportedConfigError(f"{source.folder}: a 4-bit base is quantized from HF weights; this is an "
                                         "hfmeg shard folder")
        layout = source.layout
        check_layout(layout, ps, source.folder)
        cfg, specs, vocab_multiple = source.cfg, layout.rank_chunks(ps.pp_rank), layout.vocab_multiple
        dtype = dtype or saved_dtype(layout)
    else:
        cfg = source_config(source)
        specs = rank_chunks(split_layers(cfg.num_layers, ps.pp, ps.vpp, pp_layers), ps.pp_rank)
        dtype = dtype or torch.float32
    if base_4bit is not None:
        _check_4bit(cfg)
        _map_large_blocks()
    if base_4bit is not None and isinstance(source, HFCheckpoint):
        _check_stored_4bit(source, base_4bit)
    chunks = [_load_chunk(source, cfg, spec, ps, dtype, vocab_multiple, base_4bit, options) for spec in specs]
    if base_4bit is not None:
        _release_freed_heap()
    return chunks


def load_prefix(source: MPCheckpoint, ps: ParallelState, layers: int) -> ModelChunk:
    """One chunk of the MP checkpoint's first `layers` decoder layers with both ends, at the checkpoint's TP and
    PP 1 (`parity.prefix_logits`), each tensor read from the pipeline rank folder that holds it."""
    if ps.tp != source.layout.tp or ps.pp != 1:
        raise LayoutError(f"{source.folder}: a prefix is read at the checkpoint's TP={source.layout.tp} and PP 1, "
                          f"not TP={ps.tp} PP={ps.pp}")
    held = range(min(layers, source.cfg.num_layers))
    spec = ChunkSpec(index=0, pp_rank=0, virtual=0, layers=held, pre_process=True, post_process=True)
    return _load_chunk(source, source.cfg, spec, ps, torch.float32, source.layout.vocab_multiple, None, {})


def source_config(source: HFCheckpoint | TensorSource) -> ModelConfig:
    """The model config of an HF-named source (a folder's `config.json`, and how it stores MoE experts and its LM
    head: `placement.as_stored`); a folder with a tensor nothing places or carries is refused."""
    if isinstance(source, HFCheckpoint):
        cfg = as_stored(model_config_from_hf(load_hf_config(source.folder)), source)
        check_placed(source, cfg)
        return cfg
    return source.cfg


def check_layout(layout: MPLayout, ps: ParallelState, where: Path) -> None:
    saved, run = (layout.tp, layout.pp, layout.vpp), (ps.tp, ps.pp, ps.vpp)
    if saved != run:
        raise LayoutError(
            f"{where}: saved with TP={saved[0]} PP={saved[1]} VPP={saved[2]}, but this run uses "
            f"TP={run[0]} PP={run[1]} VPP={run[2]}; reshard it with tools/reshard_mp.py --mp {where} --out NEW "
            f"--tp {run[0]} --pp {run[1]} --vpp {run[2]} (a training checkpoint keeps its optimizer, step and data "
            "position: then resume from NEW's iteration folder)"
        )


def saved_dtype(layout: MPLayout) -> torch.dtype:
    by_name = {str(d).removeprefix("torch."): d for d in DTYPES.values()}
    return by_name.get(layout.dtype, torch.float32)


def _load_chunk(source: WeightSource, cfg: ModelConfig, spec: ChunkSpec, ps: ParallelState, dtype: torch.dtype,
                vocab_multiple: int, base_4bit: Base4bit | None, options: dict) -> ModelChunk:
    with torch.device(ps.device):
        chunk = ModelChunk(cfg, ps, spec.layers, pre_process=spec.pre_process, post_process=spec.post_process,
                           vocab_multiple=vocab_multiple, **options)
    params = stored_tensors(chunk)  # grouped experts: one view per expert, under its per-expert name
    rules = chunk_rules(cfg, spec.layers, spec.pre_process, spec.post_process, chunk.experts)
    unmatched = set(params) ^ {r.local for r in rules}
    if unmatched:
        raise CheckpointError(f"{source.folder}: no conversion rule matches {sorted(unmatched)}")
    # a 4-bit base: the full-precision weights of its linears and expert stacks are dropped before anything writes
    # them (module doc)
    quantized = {r.local: layer for r in rules if (layer := _quantized_layer(chunk, r, base_4bit)) is not None}
    for layer in quantized.values():
        del layer.weight
    stacks = sorted({s for r in rules if (s := expert_stack(r)) is not None}) if base_4bit is not None else []
    for stack in stacks:
        delattr(*_stack_module(chunk, stack))
    params = stored_tensors(chunk.to(dtype=dtype))  # the cast gives the parameters new data: views made again
    with torch.no_grad():
        if isinstance(source, MPCheckpoint):
            for rule in rules:
                params[rule.local].copy_(source.local(ps.tp_rank, source.holder(ps.pp_rank, rule.local), rule.local))
        else:
            _check_shapes(source, rules, cfg)
            plain = [r for r in rules if r.local not in quantized and (not stacks or expert_stack(r) is None)]
            for rule, tensors in rule_tensors(source, plain):
                params[rule.local].copy_(to_local(rule, tensors, cfg, ps.tp, ps.tp_rank, vocab_multiple))
            for rule in [r for r in rules if r.local in quantized]:  # a stored 4-bit tensor is not dequantized
                # each float HF tensor quantized as soon as it is read: one held at a time
                tensors = [source.packed_4bit(n) if stored_packed(source, n) else
                           quantize(n, source.get(n), base_4bit.quant_type, base_4bit.double_quant) for n in rule.hf]
                packed = to_local_4bit(rule, tensors, cfg, ps.tp, ps.tp_rank, base_4bit.quant_type,
                                       base_4bit.double_quant, vocab_multiple)
                quantized[rule.local].weight_provider = Frozen4bitWeight(packed, dtype).to(ps.device)
            for stack in stacks:  # every expert's HF tensors, one stack at a time (rules_4bit.experts_4bit)
                every = stack_rules(cfg, stack)
                _check_shapes(source, every, cfg)
                packed = experts_4bit(stack, rule_tensors(source, every), cfg, ps.ep, ps.ep_rank,
                                      base_4bit.quant_type, base_4bit.double_quant)
                module, name = _stack_module(chunk, stack)
                provider = Frozen4bitWeight(packed, dtype, experts=len(chunk.experts))
                setattr(module, f"{name}_provider", provider.to(ps.device))
    return chunk


# glibc's `mallopt` parameter M_MMAP_THRESHOLD, and the block size from which a 4-bit base's process maps each block
# on its own (`_map_large_blocks`)
_M_MMAP_THRESHOLD, MAPPED_BLOCK_BYTES = -3, 1 << 20


def _glibc():
    """The C library where it is glibc (it has `mallopt` and `malloc_trim`), else None."""
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def _map_large_blocks() -> None:
    """From now on, let glibc give every heap block of `MAPPED_BLOCK_BYTES` or more its own mapping (elsewhere
    nothing).

    glibc maps a large block on its own and unmaps it when freed, but raises that size (up to 32 MiB) to each mapped
    block freed below it; from then on such blocks come from the heap, where a freed one's pages stay resident. A 4-bit
    base's load (each HF weight, the quantizer's pieces) and then every step (each linear's absmax dequantized from
    their nested codes, its weight's pieces: 1-32 MiB, forward and backward) allocate and free many blocks of those
    sizes between the long-lived codes, and each step's blocks land in other freed gaps, faulting their pages in
    again: on a 7B-shaped model (16 layers) a QLoRA rank's RSS grew ~280 MiB during its first step with nothing more
    allocated, the held bytes unchanged (docs/peft.md, "QLoRA memory vs LoRA"). A fixed threshold keeps such blocks
    out of the heap, and the freed gaps with them. The setting is the process's: its later allocations of a MiB or
    more are mapped too, each paying its page faults (small next to a 4-bit weight's dequantization on a CPU; a GPU's
    tensors are not malloc's)."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, MAPPED_BLOCK_BYTES)


def _release_freed_heap() -> None:
    """Give the pages of freed heap memory back to the system (glibc's `malloc_trim`; elsewhere nothing): the
    quantizer's temporaries below `MAPPED_BLOCK_BYTES`, freed between long-lived codes and absmax."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _check_stored_4bit(source: HFCheckpoint, base_4bit: Base4bit) -> None:
    """A `*-bnb-4bit` source is the 4-bit base as stored: its quant type and double quantization must be the run's
    (the run cannot requantize it without the float weights)."""
    fmt = source.quantized.fmt if source.quantized is not None else None
    if fmt is None or fmt.method != "bitsandbytes":
        return
    for field, run, stored, key in (("quantize", base_4bit.quant_type, fmt.quant_type, "bnb_4bit_quant_type"),
                                    ("double_quant", base_4bit.double_quant, fmt.double_quant,
                                     "bnb_4bit_use_double_quant")):
        if run != stored:
            raise UnsupportedConfigError(f"peft.{field}: {run} differs from {source.folder / 'config.json'} "
                                         f"quantization_config.{key} {stored}, a base stored 4-bit as the run reads "
                                         f"it; set peft.{field}: {stored}")


def _check_4bit(cfg: ModelConfig) -> None:
    """A 4-bit base is built for standard attention, and for MoE layers of routed SwiGLU experts without biases
    beside a plain router (Mixtral, Qwen3-MoE); anything else is refused in one line."""
    if cfg.mla is not None or cfg.linear_attention is not None:
        raise UnsupportedConfigError(f"peft.quantize: a 4-bit base is built for standard attention; "
                                     f"{cfg.model_type} has latent or linear attention")
    m = cfg.moe
    if m is not None and (m.expert_bias or m.router_scales or m.beside_dense or m.shared_expert_ffn_size):
        raise UnsupportedConfigError(f"peft.quantize: 4-bit experts are built for routed experts without biases, a "
                                     f"plain router and no shared expert (Mixtral, Qwen3-MoE); {cfg.model_type}'s "
                                     "are not")


def _stack_module(chunk: ModelChunk, stack: str) -> tuple[torch.nn.Module, str]:
    """(the grouped experts module, the parameter name) of the stacked weight `stack` (`layers.N.mlp.experts.fc1`)."""
    path, name = stack.rsplit(".", 1)
    return chunk.get_submodule(path), name


def _quantized_layer(chunk: ModelChunk, rule: TensorRule, base_4bit: Base4bit | None):
    """The TP linear whose weight `rule` fills, where the base stores it 4-bit (`rules_4bit.stored_4bit`); else
    None."""
    if base_4bit is None or expert_stack(rule) is not None or not stored_4bit(rule, chunk.cfg):
        return None
    layer = chunk.get_submodule(rule.local.removesuffix(".weight"))
    if not isinstance(layer, ColumnParallelLinear | RowParallelLinear):
        raise UnsupportedConfigError(f"{rule.local}: a 4-bit base is built for the TP column/row-parallel linears; "
                                     f"this is a {type(layer).__name__}")
    return layer


def _check_shapes(source: HFCheckpoint | TensorSource, rules: list[TensorRule], cfg: ModelConfig) -> None:
    for rule in rules:
        for j, name in enumerate(rule.hf):
            want, got = expected_hf_shape(rule, j, cfg), tuple(source.shape(name))
            if got != want:
                raise CheckpointError(
                    f"{source.folder}: tensor {name} has shape {list(got)}, config.json implies {list(want)}"
                )
