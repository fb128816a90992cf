"""`PeftConfig`: the `peft.*` section of a run, in `peft`'s own vocabulary.

The fields mean what `peft.LoraConfig`'s fields of the same name mean, so a run's
section and the exported `adapter_config.json` say the same thing:

- `method`: `none` (full fine-tuning), `lora`, or `dora` (weight-decomposed LoRA: a trained
  magnitude per output feature, `use_dora` in peft).
- `r`, `alpha`: the rank and the scale numerator; the update is `(alpha / r) B A x`, or
  `(alpha / sqrt(r)) B A x` with `use_rslora` (rank-stabilised LoRA).
- `dropout`: applied to the adapter's input only, as `peft` does.
- `target_modules`: HF projection names (`q_proj ... down_proj`), or `all-linear`
  (every projection of the decoder layers; never `lm_head`, as in `peft`). On MoE models
  (Mixtral, Qwen3-MoE) the experts' and router's names as `peft` reads them on
  transformers v5 (the family's `PeftNames.experts`): `w1`+`w3` / `gate_proj`+`up_proj` (the fused
  `gate_up_proj`, at rank 2r and alpha 2 alpha), `w2` / `down_proj`, `gate` (the router).
  Qwen2-MoE is not in peft's mapping: there the names mean what they mean to peft on that
  model, plain LoRA on `nn.Linear`s (its `PeftNames.modules`): `gate_proj up_proj down_proj` are
  the shared expert's (and a dense layer's MLP), `shared_expert_gate` its gate; `all-linear`
  is attention + those.
- `modules_to_save`: base modules trained in full beside the adapters (`embed_tokens`,
  `lm_head`; on MoE models `gate`, the router, and on Qwen2-MoE `shared_expert_gate`, which
  peft's suffix match also takes for `gate`), saved whole in the adapter file as `peft` does.
- `init_from`: a PEFT adapter folder to start from (its A and B), e.g. one `peft` made.
- `quantize`: QLoRA: the frozen base's linears stored 4-bit by bitsandbytes, `nf4` or `fp4`
  (`bnb_4bit_quant_type`; none: the base as loaded), `double_quant` its absmax quantized again
  (`bnb_4bit_use_double_quant`), `compute_dtype` what the weight is dequantized to for the matmul
  (`bnb_4bit_compute_dtype`; none: the run's `model.dtype`, the only one built). `--peft qlora` is LoRA with
  `quantize: nf4` and `double_quant` (`expand_qlora`). See `quant/qlora.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from ..errors import UnsupportedConfigError
from ..families import FAMILIES
from ..families.llama import ATTENTION, PROJECTIONS
from ..families.qwen2_moe import SHARED_GATE
from ..families.spec import PeftNames
from ..quant.nf4 import QUANT_TYPES, require_bitsandbytes
from ..quant.qlora import Base4bit

ALL_LINEAR = "all-linear"
# Base modules `modules_to_save` can train in full beside the adapters: HF name -> the chunk's parameter.
SAVABLE = {"embed_tokens": "embed.weight", "lm_head": "lm_head.weight"}
# MoE models (transformers v5 stacks the experts: `mlp.experts.gate_up_proj` [E, 2F, H], `down_proj` [E, H, F];
# the router `mlp.gate.weight`): peft (0.21) adapts them with LoRA on those parameters (`target_parameters`),
# and maps the per-expert module names of transformers v4 to them (`_MOE_TARGET_MODULE_MAPPING`); each family's
# spec says which names map to what (`PeftNames.experts`). Its own parameter names are accepted too (a peft folder
# lists them).
EXPERT_PARAMS = ("gate_up_proj", "down_proj", "gate.weight")
_TO_PARAM = {name: param for family in FAMILIES if family.peft for name, param in family.peft.experts.items()}
# Every module name some family adapts with plain LoRA, in the decoder's order.
MODULES = tuple(dict.fromkeys(m for family in FAMILIES if family.peft for m in family.peft.modules))
# `modules_to_save` names of an MoE layer's replicated parts: the router (`gate`; on Qwen2-MoE peft's suffix match
# takes `shared_expert_gate` with it) and the shared expert's gate.
MOE_SAVABLE = ("gate", SHARED_GATE)
QLORA = "qlora"  # `--peft qlora`: LoRA on an NF4 base with double quantization, as the QLoRA paper trains
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")  # model.dtype's names


def expand_qlora(section: dict) -> None:
    """`peft.method: qlora` (the `--peft qlora` shorthand) in a run's raw `peft` section -> `method: lora`,
    `quantize: nf4`, `double_quant: true` (fields the section sets itself are kept)."""
    if section.get("method") == QLORA:
        section["method"] = "lora"
        section.setdefault("quantize", "nf4")
        section.setdefault("double_quant", True)


@dataclass
class PeftConfig:
    method: Literal["none", "lora", "dora"] = "none"
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    use_rslora: bool = False
    modules_to_save: list[str] = field(default_factory=list)
    init_from: str = ""  # a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)
    quantize: Literal["nf4", "fp4"] | None = None  # QLoRA's 4-bit base (module docstring)
    double_quant: bool = True
    compute_dtype: Literal["fp32", "bf16", "fp16"] | None = None

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def scale(self) -> float:
        """What B A x is multiplied by (peft's `scaling`)."""
        return self.alpha / math.sqrt(self.r) if self.use_rslora else self.alpha / self.r

    def base_4bit(self) -> Base4bit | None:
        """How the frozen base is stored 4-bit (None: as loaded)."""
        return None if self.quantize is None else Base4bit(self.quantize, self.double_quant)

    def module_targets(self, names: PeftNames) -> tuple[str, ...]:
        """The HF module names adapted with plain LoRA on the TP (or replicated) layers of a family that calls
        them `names.modules`: those targeted, `all-linear` expanded, in the decoder's order."""
        wanted = set(self.target_modules)
        return names.modules if ALL_LINEAR in wanted else tuple(t for t in names.modules if t in wanted)

    def moe_targets(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(the attention projections, the expert/router parameters of `EXPERT_PARAMS`) targeted on an MoE
        model (each family's names are checked in `adapters.check_model`); as in peft, a dense layer's MLP of
        such a model is not adapted."""
        wanted = set(self.target_modules)
        if ALL_LINEAR in wanted:
            return ATTENTION, EXPERT_PARAMS
        params = {_TO_PARAM.get(t, t) for t in wanted}
        return tuple(p for p in ATTENTION if p in wanted), tuple(p for p in EXPERT_PARAMS if p in params)

    def param_rank(self, param: str) -> tuple[int, float]:
        """(rank, alpha) of the LoRA on an expert/router parameter (peft's rank_pattern for gate_up_proj)."""
        return (2 * self.r, 2 * self.alpha) if param == "gate_up_proj" else (self.r, self.alpha)

    def param_scale(self, param: str) -> float:
        r, alpha = self.param_rank(param)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def check(self) -> None:
        """Refuse, naming the field, what cannot be run (the model-dependent checks are in `adapters.attach`)."""
        if not self.enabled:
            if self.quantize is not None:
                raise UnsupportedConfigError(f"peft.quantize: {self.quantize} stores a frozen base for adapters; "
                                             "peft.method is none (use --peft qlora, or method lora/dora)")
            return
        if self.quantize is not None:
            if self.quantize not in QUANT_TYPES:
                raise UnsupportedConfigError(f"peft.quantize: {self.quantize!r} is not one of {QUANT_TYPES}")
            if self.compute_dtype is not None and self.compute_dtype not in COMPUTE_DTYPES:
                raise UnsupportedConfigError(f"peft.compute_dtype: {self.compute_dtype!r} is not one of "
                                             f"{COMPUTE_DTYPES}")
            require_bitsandbytes()
        if not (isinstance(self.r, int) and self.r >= 1):
            raise UnsupportedConfigError(f"peft.r: must be an integer >= 1, got {self.r!r}")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise UnsupportedConfigError(f"peft.alpha: must be a finite number > 0, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise UnsupportedConfigError(f"peft.dropout: must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules:
            raise UnsupportedConfigError("peft.target_modules: empty; name HF projections (q_proj ...) or all-linear")
        known = set(MODULES) | {ALL_LINEAR} | set(EXPERT_PARAMS) | set(_TO_PARAM)
        unknown = sorted(set(self.target_modules) - known)
        if unknown:
            raise UnsupportedConfigError(f"peft.target_modules: {unknown} match no adapted projection; the "
                                         f"targets are {list(PROJECTIONS)} or {ALL_LINEAR} (MoE models: "
                                         "also w1 w2 w3 gate, gate_up_proj down_proj gate.weight, "
                                         f"{SHARED_GATE})")
        other = sorted(set(self.modules_to_save) - set(SAVABLE) - set(MOE_SAVABLE))
        if other:
            raise UnsupportedConfigError(f"peft.modules_to_save: {other} cannot be trained in full here; the "
                                         f"modules are {list(SAVABLE)} (MoE models: also {list(MOE_SAVABLE)})")
