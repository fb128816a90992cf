"""Does a converted MP checkpoint compute what transformers computes? (tools/verify_parity.py)

`sharded_outputs` runs inside a world of TP x PP (x any DP) processes: every rank
loads its chunks with `load.load_chunks`, the prompt goes through the pipeline
(`models.generate.full_logits`), the last stage's logits are broadcast so every
rank returns them, and a greedy continuation is generated the same way.
`reference_outputs` runs `transformers` on the same token ids, in fp32.

A prefix (`prefix_logits`, `reference_prefix_logits`): the model cut after its first `layers` decoder layers, the
final norm and LM head kept, on both sides. It is what `hfmeg convert to-mp` checks after writing (a few layers
read from every TP rank's folder and the last stage's head: the conversion's per-tensor arithmetic is the same in
every layer, so these catch a wrong rule at the cost of a few layers). transformers' side is built on the meta
device from the unchanged config (so tensors that pack all layers, as Gemma 4's per-layer table, keep their
shapes), cut, and only the kept modules are materialised and read from the source; where the source's names are
not the model's (a 4.x multimodal wrapper, quantized weights transformers dequantizes on load) it loads the whole
model with `from_pretrained` and cuts that.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..families import text_config
from ..models.generate import full_logits, greedy_generate
from ..parallel.comm import gather_last_dim
from ..parallel.state import ParallelConfig, ParallelState
from .mp_layout import HF_DIR, MPLayout, resolve_iteration_dir
from .mp_reader import MPCheckpoint
from .hf_reader import HFCheckpoint
from ..errors import CheckpointError
from .load import load_chunks, load_prefix, saved_dtype

FIXED_IDS = [1, 17, 42, 7, 99, 5, 12, 3]  # when the checkpoint carries no tokenizer
PREFIX_LAYERS = 2  # what `hfmeg convert to-mp` checks after writing
TOL = 1e-4  # the numerics contract's fp32 logit bound


@dataclass
class ParityReport:
    max_abs_logit_diff: float
    ours: list[int]  # greedy continuation (new tokens only)
    reference: list[int]
    tol: float

    @property
    def ok(self) -> bool:
        return self.max_abs_logit_diff <= self.tol and self.ours == self.reference


def read_layout(mp_dir: str | Path) -> MPLayout:
    return MPLayout.read(resolve_iteration_dir(mp_dir))


def prompt_ids(mp_dir: str | Path, prompt: str, vocab_size: int):
    """(ids [1, s], tokenizer or None): the prompt tokenised with the checkpoint's tokenizer, else fixed ids."""
    hf_dir = resolve_iteration_dir(mp_dir) / HF_DIR
    if any(hf_dir.glob("tokenizer*")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(hf_dir))
        return torch.tensor([tok(prompt)["input_ids"]]), tok
    return torch.tensor([[i % vocab_size for i in FIXED_IDS]]), None


def sharded_outputs(mp_dir: str | Path, ids: torch.Tensor, max_new_tokens: int, ps: ParallelState | None = None):
    """(logits [1, s, vocab], generated ids [1, s + new]) of the sharded model, on every rank.

    Call on every rank of a world whose size is a multiple of TP x PP (or on a single
    process without torch.distributed when TP = PP = 1). `ps` defaults to the
    checkpoint's layout over the whole world.
    """
    if ps is None:
        layout = read_layout(mp_dir)
        config = ParallelConfig(tp=layout.tp, pp=layout.pp, vpp=layout.vpp)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        ps = ParallelState(config, rank, world, torch.device("cpu"))
    chunks = load_chunks(MPCheckpoint(mp_dir), ps, dtype=torch.float32)
    logits = full_logits(chunks, ps, ids)
    if ps.world_size > 1:  # from this replica's last stage (TP and CP rank 0) to its other ranks: each DP replica
        box = [logits]     # is a whole model, so a world's replicas need not wait for one another (or run at all)
        dist.broadcast_object_list(box, src=ps.grid.rank(pp=ps.pp - 1, dp=ps.dp_rank), group=ps.mp_group)
        logits = box[0]
    generated = greedy_generate(chunks, ps, ids, max_new_tokens, logits)  # every rank has the prompt's logits
    return logits, generated


@torch.no_grad()
def reference_outputs(hf_dir: str | Path, ids: torch.Tensor, max_new_tokens: int,
                      weights_dtype: torch.dtype = torch.float32):
    """(logits, generated ids) from transformers in fp32 (a multimodal wrapper's own class, on text).

    A quantized release (`quantization_config`) is loaded by transformers' dequantizing load in `weights_dtype`, the
    dtype the converted checkpoint holds (its dequantized weights rounded to it, as the converter rounds them), and
    then run in fp32 like any other."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(str(hf_dir))
    load_dtype = weights_dtype if getattr(config, "quantization_config", None) else torch.float32
    text = text_config(config)
    auto = AutoModelForCausalLM if text is config else AutoModelForImageTextToText
    # SDPA refuses soft-capped scores (Gemma): transformers' eager attention computes them.
    capped = getattr(text, "attn_logit_softcapping", None)
    model = auto.from_pretrained(str(hf_dir), dtype=load_dtype, attn_implementation="eager" if capped else None).float()
    logits = model(input_ids=ids).logits.float()
    generated = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
    return logits, generated


def compare(ours, reference, prompt_len: int, tol: float) -> ParityReport:
    (logits, gen), (ref_logits, ref_gen) = ours, reference
    diff = (logits - ref_logits).abs().max().item()
    return ParityReport(diff, gen[0, prompt_len:].tolist(), ref_gen[0, prompt_len:].tolist(), tol)


def prefix_logits(mp_dir: str | Path, ids: torch.Tensor, layers: int) -> torch.Tensor:
    """The logits `[b, s, vocab]` of the checkpoint's first `layers` layers with both ends, on every rank of a world
    of the checkpoint's TP size (or one process at TP 1)."""
    tp = read_layout(mp_dir).tp
    rank = dist.get_rank() if dist.is_initialized() else 0
    ps = ParallelState(ParallelConfig(tp=tp), rank, tp, torch.device("cpu"))
    chunk = load_prefix(MPCheckpoint(mp_dir), ps, layers)
    with torch.no_grad():
        return gather_last_dim(chunk(ids), ps)[..., : chunk.cfg.vocab_size].float()


def check_prefix(mp_dir: str | Path, hf_dir: str | Path, layers: int = PREFIX_LAYERS, tol: float = TOL) -> float:
    """The largest logit difference of the converted checkpoint's first `layers` layers from transformers' on the
    source (fixed token ids; the checkpoint's TP ranks forked here); raises CheckpointError, one line, above `tol`."""
    from ..parallel.launch import spawn

    layout = read_layout(mp_dir)
    ids = torch.tensor([[i % layout.model_config["vocab_size"] for i in FIXED_IDS]])
    ours = (spawn(prefix_logits, layout.tp, str(mp_dir), ids, layers)[0] if layout.tp > 1
            else prefix_logits(mp_dir, ids, layers))
    diff = (ours - reference_prefix_logits(hf_dir, ids, layers, saved_dtype(layout))).abs().max().item()
    if not diff <= tol:
        raise CheckpointError(f"{mp_dir}: its first {layers} layers' logits differ from transformers' on {hf_dir} by "
                              f"{diff:.3e} (> {tol:g}): the conversion is wrong (folder kept for inspection; "
                              f"`hfmeg verify --mp {mp_dir} --hf {hf_dir}` checks the whole model)")
    return diff


@torch.no_grad()
def reference_prefix_logits(hf_dir: str | Path, ids: torch.Tensor, layers: int,
                            weights_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' logits of the model cut after its first `layers` decoder layers, its weights rounded to
    `weights_dtype` (the converted checkpoint's) and run in fp32 (see the module doc)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(str(hf_dir))
    text = text_config(config)
    auto = AutoModelForCausalLM if text is config else AutoModelForImageTextToText
    with torch.device("meta"):
        model = auto.from_config(config, dtype=torch.float32, attn_implementation="eager")
    _cut(model, text.num_hidden_layers, layers)
    source = HFCheckpoint(hf_dir)
    held = set(source.keys())
    model.tie_weights()
    wanted = [n for n, _ in model.named_parameters()] + [n for n, _ in _persistent_buffers(model)]
    if getattr(config, "quantization_config", None) or not set(wanted) <= held:
        model = auto.from_pretrained(str(hf_dir), dtype=weights_dtype, attn_implementation="eager").float()
        _cut(model, text.num_hidden_layers, layers)
    else:
        model.to_empty(device="cpu")
        model.initialize_weights()  # the buffers no file holds (RoPE tables, embedding scales)
        model.load_state_dict({n: source.get(n).to(weights_dtype).float() for n in wanted}, strict=False)
        model.tie_weights()
    return model(input_ids=ids).logits.float()


def _cut(model, num_layers: int, layers: int) -> None:
    """Keep the first `layers` of the model's decoder layers (its one ModuleList of `num_layers` named `layers`)."""
    stack = next(m for n, m in model.named_modules()
                 if n.endswith("layers") and isinstance(m, torch.nn.ModuleList) and len(m) == num_layers)
    del stack[layers:]


def _persistent_buffers(model):
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buffer
