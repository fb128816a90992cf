"""A transformers model with HF's own random initialisation, for benchmarks and GPU parity.

Benchmarks and parity tests need hfmeg and transformers to start from the same
weights without a checkpoint on disk: they create the HF model here, snapshot its
weights (`checkpoint.tensor_source.TensorSource.snapshot`) and load hfmeg's chunks
from that snapshot (`checkpoint.load.load_chunks`).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig


def reference_attention(hf_config: PretrainedConfig) -> str:
    """The transformers attention to compare hfmeg with: `eager` where scores are soft-capped (SDPA has no score
    hook) or the causal-LM class has no SDPA path (gpt-oss, for its sinks), else `sdpa`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(hf_config), None)
    sdpa = cls is None or cls._supports_sdpa
    return "eager" if getattr(hf_config, "attn_logit_softcapping", None) or not sdpa else "sdpa"


def random_hf_model(hf_config: PretrainedConfig, *, seed: int, dtype: torch.dtype, device: str | torch.device = "cpu",
                    attn_implementation: str | None = None) -> torch.nn.Module:
    """A transformers causal LM with HF's own random initialisation, created directly on `device`, attending
    as `attn_implementation` (default: `reference_attention`)."""
    attention = attn_implementation or reference_attention(hf_config)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attention)
    model.config.use_cache = False  # training: no KV cache
    return model
