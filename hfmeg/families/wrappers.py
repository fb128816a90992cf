"""Multimodal checkpoints whose language model is one of hfmeg's families (its config under `text_config`).

hfmeg trains the language model; every other tensor (vision tower, projector, audio tower) and every other config
field travels verbatim into the export (`checkpoint/carried.py`), so the result loads with the wrapper's class. In
the checkpoint the language model's tensors carry a prefix: `TEXT_NAMINGS` lists the two transformers writes
(the v4 names, which `save_pretrained` still writes in 5.x, and 5.x's in-memory names); a folder's naming is the
one whose embedding it holds, and the export writes the same one back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from transformers import PretrainedConfig

from ..config import ModelConfig


@dataclass(frozen=True)
class Wrapper:
    model_types: tuple[str, ...]  # the multimodal config's model_type
    architecture: str  # its `architectures` entry
    caps_logits: bool = True  # False: its class does not apply text_config's final_logit_softcapping

    def language_model(self, cfg: ModelConfig, hf: PretrainedConfig) -> ModelConfig:
        """The language model the wrapper's class computes, from its text_config's `cfg`: the class ties its LM
        head by its own `tie_word_embeddings`, whatever text_config says (transformers 5), and may leave the
        final logits uncapped (Gemma 3's does)."""
        cfg = replace(cfg, tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)))
        return cfg if self.caps_logits else replace(cfg, final_softcap=None)


# (prefix of the text model's `model.` tensors, prefix of its `lm_head.`)
TEXT_NAMINGS = (("language_model.model.", "language_model.lm_head."), ("model.language_model.", "lm_head."))

WRAPPERS = (Wrapper(("gemma3",), "Gemma3ForConditionalGeneration", caps_logits=False),
            Wrapper(("gemma4",), "Gemma4ForConditionalGeneration"), Wrapper(("mistral3",), "Mistral3ForConditionalGeneration"),
            Wrapper(("qwen3_5",), "Qwen3_5ForConditionalGeneration"),
            Wrapper(("qwen3_5_moe",), "Qwen3_5MoeForConditionalGeneration"))


def stored_name(name: str, naming: tuple[str, str] | None) -> str:
    """The checkpoint's name of the text model's tensor `name` (`model.…` or `lm_head.…`) under `naming`."""
    if naming is None:
        return name
    for plain, prefix in zip(("model.", "lm_head."), naming):
        if name.startswith(plain):
            return prefix + name[len(plain):]
    raise ValueError(f"{name} is not a text model's tensor name")


def text_name(stored: str, naming: tuple[str, str] | None) -> str | None:
    """The text model's name of a stored tensor, None where it is not the language model's."""
    if naming is None:
        return stored
    for plain, prefix in zip(("model.", "lm_head."), naming):
        if stored.startswith(prefix):
            return plain + stored[len(prefix):]
    return None
