"""A randomly initialised transformers model as the weight source of a `ModelChunk`.

Benchmarks and parity tests need hfmeg and transformers to start from the same
weights, at sizes (LLaMA-7B layers) where writing a checkpoint to disk only to read
it back costs minutes and gigabytes. `load_chunk_from_hf` reads its source through
two methods, `get(name)` and `shape(name)` (the `HFCheckpoint` interface), so
`TensorSource`, a name -> tensor map held in memory, stands in for the folder and
the same conversion rules (QKV fusion, vocabulary padding, TP slicing) apply.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from ..config import ModelConfig
from ..errors import CheckpointError
from ..parallel.state import ParallelState
from .build import build_chunk
from .decoder import ModelChunk


class TensorSource:
    """HF-named tensors in memory, read like an `HFCheckpoint` folder."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], label: str = "<in-memory weights>"):
        self.tensors = dict(tensors)
        self.folder = label  # named in error messages, as a checkpoint folder would be

    @classmethod
    def snapshot(cls, model: torch.nn.Module, device: str | torch.device = "cpu") -> "TensorSource":
        """Copies (on `device`) of `model`'s current weights, so training `model` leaves them unchanged."""
        return cls({n: t.detach().to(device, copy=True) for n, t in model.state_dict().items()},
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


def random_hf_model(hf_config: PretrainedConfig, *, seed: int, dtype: torch.dtype,
                    device: str | torch.device = "cpu", attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A transformers causal LM with HF's own random initialisation, created directly on `device`."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation)
    model.config.use_cache = False  # training: no KV cache
    return model


def chunk_from_source(cfg: ModelConfig, source: TensorSource, ps: ParallelState, *, dtype: torch.dtype,
                      layers: range | None = None, pre_process: bool = True, post_process: bool = True,
                      vocab_multiple: int = 128, **options) -> ModelChunk:
    """A chunk on `ps.device` filled from `source` (`options` go to `ModelChunk`).

    The chunk is created on the device itself (not on the CPU and then moved), which
    matters at 7B-layer sizes: CPU initialisation of billions of parameters takes minutes.
    """
    layers = range(cfg.num_layers) if layers is None else layers
    with torch.device(ps.device):
        return build_chunk(cfg, source, ps, layers, pre_process=pre_process, post_process=post_process,
                           dtype=dtype, vocab_multiple=vocab_multiple, **options)
