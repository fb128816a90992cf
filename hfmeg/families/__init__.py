"""The model families hfmeg runs, one spec each (`spec.py`), and the registry that picks one by `model_type`.

Adding a family: a module here with its `FamilySpec` (a LLaMA-layout family is `llama.llama_layout` with its
config reader), its line in `FAMILIES`, and its tiny checkpoint in `tests/tiny_models.py` (docs/architecture.md).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from ..config import ModelConfig
from ..errors import UnsupportedConfigError
from .deepseek_v3 import DEEPSEEK_V3
from .gemma2 import GEMMA2
from .gemma3 import GEMMA3
from .gemma4 import GEMMA4
from .gpt2 import GPT2
from .gpt_oss import GPT_OSS
from .llama import LLAMA
from .ministral3 import MINISTRAL3
from .mistral import MISTRAL
from .mixtral import MIXTRAL
from .olmo2 import OLMO2
from .olmo3 import OLMO3
from .phi3 import PHI3
from .qwen2 import QWEN2
from .qwen2_moe import QWEN2_MOE
from .qwen3 import QWEN3
from .qwen3_5 import QWEN3_5, QWEN3_5_MOE
from .qwen3_moe import QWEN3_MOE
from .qwen3_next import QWEN3_NEXT
from .smollm3 import SMOLLM3
from .spec import FamilySpec
from .wrappers import WRAPPERS, Wrapper

__all__ = ["FAMILIES", "WRAPPERS", "family_of", "model_config_from_hf", "spec_of", "text_config", "wrapper_of"]

FAMILIES = (LLAMA, MISTRAL, QWEN2, QWEN3, SMOLLM3, PHI3, GEMMA2, GEMMA3, GEMMA4, OLMO2, OLMO3, MINISTRAL3, QWEN3_5,
            MIXTRAL, QWEN2_MOE, QWEN3_MOE, QWEN3_5_MOE, QWEN3_NEXT, GPT_OSS, DEEPSEEK_V3, GPT2)
_BY_TYPE = {t: spec for spec in FAMILIES for t in spec.model_types}
_WRAPPER_BY_TYPE = {t: w for w in WRAPPERS for t in w.model_types}


def family_of(model_type: str | None) -> FamilySpec:
    """The spec of HF `model_type`; refuses one hfmeg does not run, naming config.json's field."""
    if model_type not in _BY_TYPE:
        raise UnsupportedConfigError(f"config.json field model_type: {model_type!r} is not supported "
                                     f"(supported: {', '.join(_BY_TYPE)})")
    return _BY_TYPE[model_type]


def spec_of(cfg: ModelConfig) -> FamilySpec:
    return family_of(cfg.model_type)


def wrapper_of(model_type: str | None) -> Wrapper | None:
    """The multimodal wrapper `model_type` names (its language model's config is `text_config`), else None."""
    return _WRAPPER_BY_TYPE.get(model_type)


def text_config(hf: PretrainedConfig) -> PretrainedConfig:
    """The language model's config: a wrapper's `text_config`, else `hf` itself."""
    return hf.text_config if wrapper_of(getattr(hf, "model_type", None)) is not None else hf


def model_config_from_hf(hf: PretrainedConfig) -> ModelConfig:
    """Normalise a transformers config (a wrapper's language model); raise UnsupportedConfigError for what we cannot
    run."""
    text = text_config(hf)
    cfg = family_of(getattr(text, "model_type", None)).normalise(text)
    return cfg if text is hf else wrapper_of(hf.model_type).language_model(cfg, hf)
