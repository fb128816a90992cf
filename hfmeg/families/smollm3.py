"""SmolLM3: LLaMA whose layers `no_rope_layers[i] == 0` apply no RoPE (NoPE; transformers derives the list from
`no_rope_layer_interval`: every 4th layer by default), often with tied embeddings.

Its sliding window (`use_sliding_window`) is on the `layer_types` transformers marks, the NoPE layers by default
(`llama.layer_types_window`)."""

from __future__ import annotations

from dataclasses import replace

from transformers import PretrainedConfig

from ..config import ModelConfig, require
from .llama import Window, decoder_config, layer_types_window, llama_layout


def window(hf: PretrainedConfig) -> Window:
    return layer_types_window(hf) if getattr(hf, "use_sliding_window", False) else (None, ())  # sliding_window alone is unused


def normalise(hf: PretrainedConfig) -> ModelConfig:
    flags = list(hf.no_rope_layers)
    require(len(flags) == hf.num_hidden_layers, "no_rope_layers",
            f"{len(flags)} entries for num_hidden_layers={hf.num_hidden_layers}")
    return replace(decoder_config(hf, window=window), nope_layers=tuple(i for i, rope in enumerate(flags) if not rope))


SMOLLM3 = llama_layout(("smollm3",), "SmolLM3ForCausalLM", normalise)
