"""HF-named tensors held in memory, read like an HF checkpoint folder.

Benchmarks and parity tests need hfmeg and transformers to start from the same
weights, at sizes (LLaMA-7B layers) where writing a checkpoint to disk only to read
it back costs minutes and gigabytes. The loader (`checkpoint.load`) reads HF-named
sources through `get(name)` and `shape(name)` (the `HFCheckpoint` interface), so a
`TensorSource` stands in for the folder and the same conversion rules (QKV fusion,
vocabulary padding, TP slicing) apply. It carries its `ModelConfig`, as a folder
carries its `config.json`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..config import ModelConfig
from ..families import model_config_from_hf
from ..errors import CheckpointError
from .rules import with_expert_layout


class TensorSource:
    """HF-named tensors in memory with the model config they belong to."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, label: str = "<in-memory weights>"):
        self.tensors = dict(tensors)
        self.cfg = cfg
        self.folder = label  # named in error messages, as a checkpoint folder would be

    @classmethod
    def snapshot(cls, model: torch.nn.Module, device: str | torch.device = "cpu") -> "TensorSource":
        """Copies (on `device`) of a transformers model's current weights, so training it leaves them unchanged."""
        tensors = {n: t.detach().to(device, copy=True) for n, t in model.state_dict().items()}
        # transformers holds MoE experts stacked per layer (rules.with_expert_layout)
        return cls(tensors, with_expert_layout(model_config_from_hf(model.config), tensors),
                   f"<snapshot of {type(model).__name__}>")

    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise CheckpointError(f"{self.folder}: tensor {name} is missing")
        return self.tensors[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.get(name).shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.get(name).dtype
