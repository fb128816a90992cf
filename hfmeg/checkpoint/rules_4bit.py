"""A rank's 4-bit base weights (QLoRA), made from the HF tensors as `rules.to_local` makes a weight.

peft + transformers' `BitsAndBytesConfig(load_in_4bit=True)` quantize each HF `nn.Linear` weight whole, so that is
what is quantized here: each HF tensor of the rule, once, by bitsandbytes (`quant/nf4.py`). Their codes and absmax
are indexed by the weight's rows, so they are put part after part exactly as the weight's rows are
(`rules.parts_in_order`) and cut by the rule's split kind: each rank's dequantized weight is then its slice of the
dequantized HF weights (QKV fused per KV group, gate/up per rank, and so on), bit for bit. Quantizing the fused
tensor instead would give other double-quantization constants than bitsandbytes gives each HF tensor. An HF tensor
a `*-bnb-4bit` checkpoint stores 4-bit already comes as its stored `Packed4bit` and is cut as it is (no
dequantize / requantize round).

MoE layers (transformers v5 holds the routed experts as two stacked parameters, not `nn.Linear`s):
- `load_in_4bit` replaces `nn.Linear`s only, so it leaves the router (a bare `[experts, hidden]` parameter in every
  v5 MoE family) and the stacked experts in full precision (bitsandbytes issue 1849). The router stays so here.
- The experts are most of an MoE's weights, so hfmeg stores them 4-bit, as bitsandbytes' own API for such
  parameters does (`bitsandbytes.nn.parametrize.replace_parameter_4bit`): the whole stacked parameter, gate_up
  `[E, 2F, H]` (each expert's `[gate; up]`) or down `[E, H, F]`, quantized once, its blocks running over the
  flattened stack (`experts_4bit`). Its double-quantization constants are those of all E experts together, so every
  expert-parallel rank quantizes the layer's whole stack (one stack in memory at a time) and keeps its own experts'
  codes and absmax (`splits.EXPERTS`); a rank that quantized only its experts would get other absmax.

A merge of a QLoRA adapter asks `Dequantized4bit` for the base as the run held it: each 4-bit HF tensor quantized and
dequantized alone, or as part of its whole expert stack.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch

from ..config import VOCAB_MULTIPLE, ModelConfig
from ..errors import UnsupportedConfigError
from ..families.spec import TensorRule
from ..parallel.splits import EXPERTS
from ..quant.nf4 import Nested, Packed4bit, dequantize, held_bytes, joined, quantize, shard
from .hf_reader import HFCheckpoint
from .rules import chunk_rules, expected_hf_shape, parts_in_order, rule_tensors, split_of, to_hf, to_local

# A routed expert's weight, as the key table names it (`parallel/stored_names.py`): its stack and the expert.
_EXPERT = re.compile(r"^(?P<stack>layers\.\d+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<name>fc[12])\.weight$")


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
    whole = joined(packed, lambda pieces: parts_in_order(rule, pieces))
    return shard(rule.local, whole, split_of(rule, cfg, vocab_multiple), tp, tp_rank)


def stored_packed(source, name: str) -> bool:
    """Whether `source` stores the HF tensor `name` as bitsandbytes 4-bit codes (a `*-bnb-4bit` checkpoint's linear),
    which a 4-bit base takes as they are."""
    return isinstance(source, HFCheckpoint) and source.stored_4bit(name)


def expert_stack(rule: TensorRule) -> str | None:
    """The stacked weight (`layers.N.mlp.experts.fc1`) whose expert `rule` fills; None for any other rule."""
    m = _EXPERT.match(rule.local)
    return None if m is None else f"{m['stack']}.{m['name']}"


def stack_rules(cfg: ModelConfig, stack: str) -> list[TensorRule]:
    """The rules of every expert of `stack` (all experts, whatever a rank holds), in expert order."""
    layer = int(stack.split(".")[1])
    return [r for r in chunk_rules(cfg, [layer], False, False) if expert_stack(r) == stack]


def experts_4bit(stack: str, pairs: Iterable[tuple[TensorRule, list[torch.Tensor]]], cfg: ModelConfig, ep: int,
                 ep_rank: int, quant_type: str = "nf4", double_quant: bool = True) -> Packed4bit:
    """EP rank `ep_rank`'s experts of the stacked weight `stack`, 4-bit, as rows `[E_local rows, cols]`: every
    expert's weight (`pairs`: each expert's rule and HF tensors, in expert order) stacked as transformers holds the
    parameter, quantized whole (module docstring) and cut over EP."""
    full = torch.stack([to_local(rule, hf, cfg, 1, 0) for rule, hf in pairs])
    return shard(stack, quantize(stack, full.flatten(0, 1), quant_type, double_quant), EXPERTS, ep, ep_rank)


def held_4bit_bytes(cfg: ModelConfig, rules: list[TensorRule], tp: int, tp_rank: int, ep: int, ep_rank: int,
                    double_quant: bool, vocab_multiple: int = VOCAB_MULTIPLE, blocksize: int = 64) -> int:
    """Bytes a rank holds of the 4-bit weights among its `rules` (the planner's count, from shapes): each weight cut
    as `to_local_4bit` / `experts_4bit` cut it, on a stand-in whose absmax index is the real layout's, so the nested
    absmax are counted where the rank holds them so (`nf4.held_bytes`). Layers of one shape are traced once."""
    traced: dict[tuple, int] = {}
    stacks = set()
    total = 0
    for rule in [r for r in rules if stored_4bit(r, cfg)]:
        stack = expert_stack(rule)
        if stack in stacks:
            continue
        shapes = tuple(expected_hf_shape(rule, j, cfg) for j in range(len(rule.hf)))
        key = (re.sub(r"^layers\.\d+\.", "", stack or rule.local), shapes)
        if key not in traced and stack is None:
            parts = [_stand_in(shape, double_quant, blocksize) for shape in shapes]
            traced[key] = held_bytes(to_local_4bit(rule, parts, cfg, tp, tp_rank, "nf4", double_quant,
                                                   vocab_multiple))
        elif key not in traced:  # the whole stack: its rank's experts cut over EP
            byte = torch.zeros((), dtype=torch.uint8)  # (meta tensors would have `cat` import torch._dynamo)
            out, cols = to_local(rule, [byte.expand(s) for s in shapes], cfg, 1, 0).shape
            whole = _stand_in((len(stack_rules(cfg, stack)) * out, cols), double_quant, blocksize)
            traced[key] = held_bytes(shard(stack, whole, EXPERTS, ep, ep_rank))
        if stack is not None:
            stacks.add(stack)
        total += traced[key]
    return total


def _stand_in(shape: tuple[int, int], double_quant: bool, blocksize: int) -> Packed4bit:
    """A 4-bit weight of `shape` for counting: its absmax index (each absmax's nested block; bitsandbytes' 256 a
    block), which also stands in for its codes and absmax (`held_bytes` counts the codes from the absmax)."""
    rows, cols = shape
    blocks = rows * cols // blocksize
    index = (torch.arange(blocks, dtype=torch.int32) // 256 * 256).view(rows, -1)
    n = -(-blocks // 256)
    nested = Nested(index, torch.zeros(n), torch.zeros(n), torch.zeros(256), 256) if double_quant else None
    return Packed4bit(index, index, "nf4", blocksize, torch.float32, nested)


def stored_4bit(rule: TensorRule, cfg: ModelConfig) -> bool:
    """Whether a 4-bit base stores the weight `rule` makes: a 2-d weight of a decoder layer (its attention and
    MLP linears; not the norms, the embedding, the LM head or an MoE router, as transformers' `load_in_4bit` leaves
    them) or a routed expert's (module docstring)."""
    if expert_stack(rule) is not None:
        return True
    return (rule.local.startswith("layers.") and rule.local.endswith(".weight")
            and not rule.local.endswith(".mlp.router.weight")
            and all(len(expected_hf_shape(rule, j, cfg)) == 2 for j in range(len(rule.hf))))


class Dequantized4bit:
    """The HF tensors of a whole model that its 4-bit base holds 4-bit, as that base dequantizes them (a QLoRA
    merge's base: peft's `merge_and_unload` on the dequantized model), asked for one at a time while a merge streams
    the base (`source`, `cfg` as stored): a weight held alone is quantized and dequantized as it comes; the first
    tensor of an expert stack has the whole stack quantized from `source` and dequantized (`experts_4bit`), its
    other tensors kept until they are asked for (one stack's at a time where the files hold them in order)."""

    def __init__(self, source, cfg: ModelConfig, quant_type: str, double_quant: bool):
        self.source, self.cfg, self.quant_type, self.double_quant = source, cfg, quant_type, double_quant
        rules = chunk_rules(cfg, range(cfg.num_layers), True, True)
        self.alone = {n for r in rules if stored_4bit(r, cfg) and expert_stack(r) is None for n in r.hf}
        self.stacks = {n: s for r in rules if (s := expert_stack(r)) is not None for n in r.hf}
        self.pending: dict[str, torch.Tensor] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.alone or name in self.stacks

    def get(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """The HF tensor `name` (read as `weight`) as the 4-bit base holds it, dequantized, in its dtype."""
        if name in self.alone:
            if stored_packed(self.source, name):
                return weight  # a `*-bnb-4bit` base's: read dequantized from the codes the run held as they are
            return dequantize(quantize(name, weight, self.quant_type, self.double_quant)).to(weight.dtype)
        if name not in self.pending:
            self.pending |= self._stack(self.stacks[name])
        return self.pending.pop(name).to(weight.dtype)

    def _stack(self, stack: str) -> dict[str, torch.Tensor]:
        """Every HF tensor of the expert stack `stack`, dequantized from its 4-bit storage."""
        rules = stack_rules(self.cfg, stack)
        packed = experts_4bit(stack, rule_tensors(self.source, rules), self.cfg, 1, 0, self.quant_type,
                              self.double_quant)
        full = dequantize(packed).unflatten(0, (len(rules), -1))
        pieces: dict[str, list[torch.Tensor]] = {}
        for e, rule in enumerate(rules):
            for name, t in to_hf(rule, [full[e]], self.cfg).items():
                pieces.setdefault(name, []).append(t)
        # an HF tensor stacking every expert (`rule.expert`) gets them all back; one per expert its own
        return {name: torch.stack(ts) if rules[0].expert is not None else ts[0] for name, ts in pieces.items()}
