"""`FamilySpec`: everything hfmeg knows about one model family, in one value.

A family is the set of HF `model_type`s that share a weight layout and a config reader.
Its spec says how to normalise the HF config (`normalise`, which also sets the feature
switches `ModelConfig` carries: biases, QK-norm, window, MoE ...), how its HF tensors map
to hfmeg's (`layer_rules` and the names of the tensors around the layers), how a
checkpoint names its experts, and what `peft` calls its adaptable modules. Everything
else asks the spec (`families.family_of`) and never tests a `model_type` string.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Collection

from transformers import PretrainedConfig

from ..config import ModelConfig


@dataclass(frozen=True)
class TensorRule:
    """How one hfmeg tensor is made from HF tensors: its hfmeg name, the HF names, the split kind
    (`checkpoint/rules.py` moves the data)."""

    local: str
    hf: tuple[str, ...]
    kind: str
    transpose: bool = False
    tied: bool = False  # a stage-local copy of the tied embedding: nothing to write back
    shapes: tuple[tuple[int, ...], ...] | None = None  # HF shapes, where the kind does not imply them
    expert: int | None = None  # the HF tensor stacks all experts on dim 0: this rule is expert `expert`'s slice
    pieces: tuple[int, ...] | None = None  # kind `parts`: the row counts of the pieces split over TP one by one
    layer: int | None = None  # kinds `qkv` and an attention's `cols`: the decoder layer whose attention shape applies
    # kind `parts`: each HF tensor's rows are laid out by `groups` groups, each holding its share of every piece the
    # tensor holds (Qwen3-Next's `in_proj_qkvz`: per key head, [q; k; v; z] of it); None: piece after piece
    groups: int | None = None


@dataclass(frozen=True)
class ExpertNames:
    """How a checkpoint written by `save_pretrained` names an MoE layer's experts, one tensor per expert:
    `model.layers.{i}.{block}experts.{e}.{gate|up|down}.weight`, the router `{block}gate.weight`. (Stacked
    experts, as transformers holds them in memory, have the same names in every family: `llama.py`.)"""

    block: str  # "mlp." or Mixtral's "block_sparse_moe."
    gate: str
    up: str
    down: str
    shared: str = "shared_expert."  # the always-on expert's module (DeepSeek's: "shared_experts.")

    @property
    def projections(self) -> tuple[str, str, str]:
        return self.gate, self.up, self.down


@dataclass(frozen=True)
class PeftNames:
    """What `peft` calls this family's adaptable modules.

    `modules`: the names adapted with plain LoRA on `nn.Linear`s, in the decoder's order (what `all-linear`
    stands for). `experts`: on families whose stacked experts peft maps (`target_parameters`), each target
    name -> the parameter it adapts (`gate_up_proj`, `down_proj`, the router `gate.weight`); `fused`: the two
    names peft fuses into one LoRA on `gate_up_proj` (rank 2r). `fused_bases`: hfmeg's fused bases (`attn.qkv`,
    `mlp.fc1`) that the family's HF checkpoints fuse too (Phi-3's `qkv_proj`, `gate_up_proj`) -> that module's
    name: peft's LoRA there is one A and one B over all the fused rows, and so is hfmeg's (`peft/adapters.py`)."""

    modules: tuple[str, ...]
    experts: dict[str, str] = field(default_factory=dict)
    fused: tuple[str, str] | None = None
    fused_bases: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FamilySpec:
    model_types: tuple[str, ...]
    architecture: str  # the causal-LM class config.json's `architectures` names
    normalise: Callable[[PretrainedConfig], ModelConfig]  # refuses what hfmeg cannot run, naming the field
    # (cfg, layer, the experts a chunk holds) -> the rules of that decoder layer's tensors
    layer_rules: Callable[[ModelConfig, int, Collection[int]], list[TensorRule]]
    embedding: str  # the token embedding's HF tensor
    final_norm: str  # the final norm's HF module (`.weight`, and `.bias` for a LayerNorm)
    position_embedding: str | None = None  # learned positions' HF tensor
    experts: ExpertNames | None = None  # MoE families
    peft: PeftNames | None = None  # None: LoRA is not built for this family
    # (HF tensor name, config.json as a dict) -> whether it is a tensor the family's checkpoints hold that transformers
    # does not compute with either (DeepSeek-V3's MTP layers): carried verbatim, unchecked (`checkpoint/carried.py`).
    carried: Callable[[str, dict], bool] = lambda name, config: False
    # The rules of the tensors the first stage holds beside the token embedding (Gemma 4's per-layer input tables).
    first_stage: Callable[[ModelConfig], list[TensorRule]] = lambda cfg: []
