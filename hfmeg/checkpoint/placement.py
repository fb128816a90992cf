"""What an HF checkpoint's tensors become, decided from the checkpoint as stored, and the check that none is lost.

Two things config.json alone does not say:
- How MoE experts are stored (per expert, or stacked): read off the tensor names (`rules.with_expert_layout`).
- Whether the LM head is tied. transformers 5 ties it to the embedding where the config says so, unless the
  checkpoint holds an LM head whose values differ from the embedding's: then it keeps both (and warns). Mistral 3's
  published wrappers are such checkpoints: their config has no `tie_word_embeddings` (the class defaults to true) and
  they hold an untied `language_model.lm_head.weight`. hfmeg computes what transformers computes, so it unties there.
  An LM head equal to the embedding under a tied config is the tied head itself: it is placed as the embedding and
  the export leaves it out (transformers ties it again on loading).

`check_placed` then refuses a checkpoint holding any tensor that the family's rules do not place and that is not
carried verbatim (`HFCheckpoint.carried`): converting it would drop the tensor silently.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..config import ModelConfig
from ..errors import CheckpointError
from .rules import chunk_rules, with_expert_layout

HEAD = "lm_head.weight"


def as_stored(cfg: ModelConfig, source) -> ModelConfig:
    """`cfg` with the expert layout and the LM head's tying as `source` (an HF-named source) stores them."""
    cfg = with_expert_layout(cfg, source)
    if cfg.tie_embeddings and HEAD in source and not _same(source.get(HEAD), source.get(_embedding(cfg))):
        cfg = replace(cfg, tie_embeddings=False)
    return cfg


def as_saved(cfg: ModelConfig, layout_config: dict) -> ModelConfig:
    """`cfg`, read from an MP folder's copy of config.json, with the LM head untied where the conversion untied it
    (`as_stored`), as the folder's layout records (`MPLayout.model_config`)."""
    return cfg if layout_config.get("tie_embeddings", True) else replace(cfg, tie_embeddings=False)


def _embedding(cfg: ModelConfig) -> str:
    return chunk_rules(cfg, (), True, False)[0].hf[0]


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)


def check_placed(source, cfg: ModelConfig) -> None:
    """Refuse `source` (an `HFCheckpoint`) if a tensor of it is neither placed by `cfg`'s rules nor carried."""
    names = {n for rule in chunk_rules(cfg, range(cfg.num_layers), True, True) for n in rule.hf}
    if cfg.tie_embeddings:
        names.add(HEAD)  # a stored tied head (`as_stored` found it equal to the embedding)
    kept = {source.resolve(n) for n in names if n in source} | set(source.carried)
    lost = [k for k in source.keys() if source.resolve(k) not in kept]
    if lost:
        more = f" and {len(lost) - 1} more" if len(lost) > 1 else ""
        raise CheckpointError(f"{source.folder}: tensor {lost[0]}{more} is not placed by the {cfg.model_type} "
                              "conversion rules and not carried; converting would drop it (not supported)")
