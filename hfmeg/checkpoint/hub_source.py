"""Turn `--hf <folder or Hub id>` into a local folder.

A path that exists is used as is and never touches the network. Anything else
that looks like a Hub repository id is fetched with
`huggingface_hub.snapshot_download`, which reuses the local cache and honours
`HF_HUB_OFFLINE` (offline, it answers from the cache or fails). Only config,
tokenizer and weight files are fetched, and `.bin` weights only for repositories
that have no safetensors; with `weights=False` (a run from random weights, which reads
only the config and tokenizer) no weight file at all.
"""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import snapshot_download

from ..errors import CheckpointError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
SIDE_PATTERNS = ["*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "chat_template.*"]
SAFE_PATTERNS = ["*.safetensors", "model.safetensors.index.json"]
BIN_PATTERNS = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]


def resolve_hf_source(spec: str | Path, weights: bool = True) -> Path:
    """A local folder for `spec` (a folder, or a Hub id downloaded/cached by huggingface_hub)."""
    path = Path(spec)
    if path.is_dir():
        return path
    text = str(spec)
    if path.exists() or path.is_absolute() or text.startswith((".", "~")) or not REPO_ID.match(text):
        raise CheckpointError(f"{spec}: no such folder")
    try:
        safetensors = SAFE_PATTERNS if weights else []
        folder = Path(snapshot_download(repo_id=text, allow_patterns=SIDE_PATTERNS + safetensors))
        if weights and not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(repo_id=text, allow_patterns=SIDE_PATTERNS + BIN_PATTERNS))
    except Exception as e:  # noqa: BLE001 - every Hub failure becomes one clear line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(
            f"{spec}: not a local folder, and fetching it from the Hub failed ({type(e).__name__}: {first})"
        ) from e
    return folder
