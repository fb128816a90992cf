"""`make demo`: the built-in default job.

Builds a tiny LLaMA checkpoint with transformers, shards it TP=2 over two gloo
processes, and shows that the sharded model computes what transformers computes:
the logits' max-abs difference and a 20-token greedy continuation from each.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

from hfmeg.models import build_chunk_from_hf
from hfmeg.models.generate import full_logits, greedy_generate
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.state import ParallelConfig, ParallelState


def make_tiny_llama(folder: Path) -> Path:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=1000, max_position_embeddings=256)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return folder


def _sharded(folder: str, ids: torch.Tensor, new_tokens: int):
    ps = ParallelState(ParallelConfig(tp=2), dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    chunk = build_chunk_from_hf(folder, ps)
    return full_logits([chunk], ps, ids), greedy_generate([chunk], ps, ids, new_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="out/demo", help="where the tiny checkpoint is written")
    args = ap.parse_args()
    folder = make_tiny_llama(Path(args.out) / "hf")
    ids = torch.tensor([[1, 17, 42, 7, 300, 5, 99, 12]])
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        ref_logits = ref(ids).logits
    ref_gen = ref.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    logits, gen = spawn(_sharded, 2, str(folder), ids, 20)[0]
    diff = (logits - ref_logits).abs().max().item()
    print(f"checkpoint        : {folder} (tiny LLaMA, {sum(p.numel() for p in ref.parameters()):,} params)")
    print("layout            : TP=2 on 2 gloo processes")
    print(f"max |logit diff|  : {diff:.2e}")
    print(f"transformers greedy: {ref_gen[0, ids.shape[1]:].tolist()}")
    print(f"hfmeg TP=2 greedy  : {gen[0, ids.shape[1]:].tolist()}")
    ok = diff <= 1e-4 and torch.equal(gen, ref_gen)
    print("PARITY OK" if ok else "PARITY FAILED")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
