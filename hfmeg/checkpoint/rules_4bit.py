"""A TP rank's 4-bit base weight (QLoRA), made from the HF tensors as `rules.to_local` makes a weight.

peft + transformers' `BitsAndBytesConfig(load_in_4bit=True)` quantize each HF `nn.Linear` weight whole, so that is
what is quantized here: each HF tensor of the rule, once, by bitsandbytes (`quant/nf4.py`). Their codes and absmax
are indexed by the weight's rows, so they are put part after part exactly as the weight's rows are
(`rules.parts_in_order`) and cut by the rule's split kind: each rank's dequantized weight is then its slice of the
dequantized HF weights (QKV fused per KV group, gate/up per rank, and so on), bit for bit. Quantizing the fused
tensor instead would give other double-quantization constants than bitsandbytes gives each HF tensor. An HF tensor
a `*-bnb-4bit` checkpoint stores 4-bit already comes as its stored `Packed4bit` and is cut as it is (no
dequantize / requantize round).
"""

from __future__ import annotations

import torch

from ..config import VOCAB_MULTIPLE, ModelConfig
from ..errors import UnsupportedConfigError
from ..families.spec import TensorRule
from ..quant.nf4 import Packed4bit, quantize, shard
from .rules import chunk_rules, expected_hf_shape, parts_in_order, split_of


def to_local_4bit(rule: TensorRule, hf: list[torch.Tensor | Packed4bit], cfg: ModelConfig, tp: int, tp_rank: int,
                  quant_type: str = "nf4", double_quant: bool = True,
                  vocab_multiple: int = VOCAB_MULTIPLE) -> Packed4bit:
    """This TP rank's share of `rule.local` stored 4-bit, from the full HF tensors named by `rule.hf` (each a float
    tensor, quantized here, or one stored 4-bit, of the run's `quant_type`)."""
    if rule.expert is not None or rule.transpose or any(len(t.shape) != 2 for t in hf):
        raise UnsupportedConfigError(f"{rule.local}: 4-bit storage is built for 2-d nn.Linear weights read as they "
                                     "are (not stacked experts, nor GPT-2's transposed Conv1D)")
    packed = [t if isinstance(t, Packed4bit) else quantize(name, t, quant_type, double_quant)
              for name, t in zip(rule.hf, hf)]
    for name, p in zip(rule.hf, packed):
        if (p.quant_type, p.blocksize) != (quant_type, packed[0].blocksize):
            raise UnsupportedConfigError(f"{name}: stored {p.quant_type} in blocks of {p.blocksize}; this 4-bit base "
                                         f"is {quant_type} in blocks of {packed[0].blocksize} ({rule.local})")
    whole = Packed4bit(parts_in_order(rule, [p.codes for p in packed]),
                       parts_in_order(rule, [p.absmax for p in packed]), quant_type, packed[0].blocksize,
                       packed[0].dtype)
    return shard(rule.local, whole, split_of(rule, cfg, vocab_multiple), tp, tp_rank)


def stored_4bit(rule: TensorRule, cfg: ModelConfig) -> bool:
    """Whether a 4-bit base stores the weight `rule` makes: a 2-d weight of a decoder layer (its attention and
    MLP linears; not the norms, the embedding or the LM head, as transformers' `load_in_4bit` leaves them)."""
    return (rule.local.startswith("layers.") and rule.local.endswith(".weight")
            and all(len(expected_hf_shape(rule, j, cfg)) == 2 for j in range(len(rule.hf))))


def hf_names_4bit(cfg: ModelConfig) -> set[str]:
    """The HF tensors of a whole model that a 4-bit base stores 4-bit (`stored_4bit`)."""
    rules = chunk_rules(cfg, range(cfg.num_layers), True, True)
    return {name for rule in rules if stored_4bit(rule, cfg) for name in rule.hf}
