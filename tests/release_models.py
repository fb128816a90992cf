"""Tiny random checkpoints of published releases (`tests/releases/<name>.json`: the release's `config.json` with its
sizes shrunk and every other field as published; where each came from is in its `source`).

`save_release` builds the model transformers builds from that config, gives it random weights (`tiny_models.perturb`)
in the published `torch_dtype`, saves it, and writes the shrunk published `config.json` back verbatim over the one
`save_pretrained` wrote (which would rename legacy keys). A multimodal wrapper's tensors are written under the naming
of the transformers version asked for: 4.x (`language_model.model.…`, `language_model.lm_head.…`, `vision_tower.…`)
or 5.x (`model.language_model.…`, `lm_head.…`, `model.vision_tower.…`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tiny_models import perturb

RELEASES = Path(__file__).resolve().parent / "releases"
# A wrapper's tensor prefixes: (transformers 4.x, 5.x)
WRAPPER_NAMES = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                 ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))


def published(name: str) -> dict:
    """The release's shrunk published config.json."""
    return json.loads((RELEASES / f"{name}.json").read_text())["config"]


def renamed(key: str, layout: str) -> str:
    """`key` under the wrapper naming of transformers `layout` ("4.x" or "5.x")."""
    to = layout == "5.x"
    for pair in WRAPPER_NAMES:
        if key.startswith(pair[not to]):
            return pair[to] + key[len(pair[not to]):]
    return key


def save_release(name: str, folder: Path, *, layout: str | None = None, seed: int = 0) -> Path:
    """A random tiny checkpoint of release `name` in `folder`; `layout`: a wrapper's tensor naming."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = published(name)
    fields = {k: v for k, v in published(name).items() if k != "model_type"}  # a copy: transformers edits rope dicts
    wrapper = "text_config" in config
    # A wrapper is built untied (its own LM head), whatever the class's default: the published wrappers hold one.
    hf = AutoConfig.for_model(config["model_type"], **(fields | {"tie_word_embeddings": False} if wrapper else fields))
    torch.manual_seed(seed)
    model = (AutoModelForImageTextToText if wrapper else AutoModelForCausalLM).from_config(hf, dtype=torch.float32)
    perturb(model)
    model.to(getattr(torch, config.get("torch_dtype") or "float32")).save_pretrained(folder)
    if wrapper:
        for path in folder.glob("*.safetensors"):
            save_file({renamed(k, layout): v for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
