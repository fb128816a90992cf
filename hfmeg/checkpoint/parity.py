"""Does a converted MP checkpoint compute what transformers computes? (tools/verify_parity.py)

`sharded_outputs` runs inside a world of TP x PP (x any DP) processes: every rank
loads its chunks with `load.load_chunks`, the prompt goes through the pipeline
(`models.generate.full_logits`), the last stage's logits are broadcast so every
rank returns them, and a greedy continuation is generated the same way.
`reference_outputs` runs `transformers` on the same token ids, in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..families import text_config
from ..models.generate import full_logits, greedy_generate
from ..parallel.state import ParallelConfig, ParallelState
from .mp_layout import HF_DIR, MPLayout, resolve_iteration_dir
from .mp_reader import MPCheckpoint
from .load import load_chunks

FIXED_IDS = [1, 17, 42, 7, 99, 5, 12, 3]  # when the checkpoint carries no tokenizer


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
    generated = greedy_generate(chunks, ps, ids, max_new_tokens)
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
