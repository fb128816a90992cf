"""A transformers model with HF's own random initialisation, for benchmarks and GPU parity.

Benchmarks and parity tests need hfmeg and transformers to start from the same
weights without a checkpoint on disk: they create the HF model here, snapshot its
weights (`checkpoint.tensor_source.TensorSource.snapshot`) and load hfmeg's chunks
from that snapshot (`checkpoint.load.load_chunks`).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig


def random_hf_model(hf_config: PretrainedConfig, *, seed: int, dtype: torch.dtype,
                    device: str | torch.device = "cpu", attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A transformers causal LM with HF's own random initialisation, created directly on `device`."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation)
    model.config.use_cache = False  # training: no KV cache
    return model
