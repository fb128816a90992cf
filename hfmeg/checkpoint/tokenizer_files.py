"""Tokenizer folders that every transformers version `pyproject.toml` allows reads alike.

transformers 5 saves any fast tokenizer under the class name `TokenizersBackend`, which 4.x does
not know, leaves `clean_up_tokenization_spaces` out (5 reads that as False, 4.x as True), and puts
the chat template in `chat_template.jinja`, which 4.45 does not read. `PreTrainedTokenizerFast`
(the same class in 5), an explicit `clean_up_tokenization_spaces` and a `chat_template` field in
`tokenizer_config.json` mean the same to both.

4.x's `PreTrainedTokenizerFast` also returns `token_type_ids` unless `model_input_names` says otherwise, and a
causal LM's `generate(**tok(text, return_tensors="pt"))` then raises on the unknown argument: every model hfmeg
writes is decoder-only, so its tokenizer config names the inputs such a model takes (`DECODER_INPUTS`).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CheckpointError
from .atomic import write_text_atomic

CONFIG_FILE = "tokenizer_config.json"
JINJA_FILE = "chat_template.jinja"
PORTABLE_CLASS = "PreTrainedTokenizerFast"
TRANSFORMERS_5_CLASS = "TokenizersBackend"
DECODER_INPUTS = ["input_ids", "attention_mask"]


def save_tokenizer(tokenizer, folder: Path) -> None:
    """`tokenizer.save_pretrained(folder)`, chat template in the config, made portable (`make_portable`)."""
    tokenizer.save_pretrained(folder, save_jinja_files=False)
    make_portable(Path(folder))


def make_portable(folder: Path, chat_template: str | None = None) -> None:
    """Rewrite `folder`'s tokenizer config so that 4.x reads it as 5 does, its `chat_template.jinja` copied in;
    with `chat_template`, record that there (for a tokenizer that has none: the template a run trained with,
    `Trainer.export`)."""
    path = Path(folder) / CONFIG_FILE
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from e
    before = dict(config)
    config.setdefault("model_input_names", DECODER_INPUTS)
    if config.get("tokenizer_class") == TRANSFORMERS_5_CLASS:
        config["tokenizer_class"] = PORTABLE_CLASS
        config.setdefault("clean_up_tokenization_spaces", False)  # what 5 reads for a missing field
    jinja = path.with_name(JINJA_FILE)
    if chat_template is None and "chat_template" not in config and jinja.is_file():
        chat_template = jinja.read_text()  # copied, the file kept: the same template for either reader
    if chat_template is not None:
        config["chat_template"] = chat_template
    if config != before:
        write_text_atomic(path, json.dumps(config, indent=2, ensure_ascii=False) + "\n")
