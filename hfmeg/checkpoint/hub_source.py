"""Turn `--hf <folder or Hub id>` into a local folder.

A path that exists is used as is and never touches the network. Anything else
that looks like a Hub repository id is fetched with
`huggingface_hub.snapshot_download`, which reuses the local cache and honours
`HF_HUB_OFFLINE` (offline, it answers from the cache or fails). Only config,
tokenizer and weight files are fetched, and `.bin` weights only for repositories
that have no safetensors; with `weights=False` (a run from random weights, which reads
only the config and tokenizer) no weight file at all.

Offline without `HF_HUB_OFFLINE`, huggingface_hub retries a connection that cannot be made
for about half a minute before it fails. So a repository id that the local cache cannot
answer is first checked against the Hub's reachability (`hub_unreachable`: one TCP connect
with a few seconds' timeout), and an unreachable Hub is one line at once.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from urllib.parse import urlparse

from huggingface_hub import constants, snapshot_download

from ..errors import CheckpointError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
SIDE_PATTERNS = ["*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "chat_template.*"]
SAFE_PATTERNS = ["*.safetensors", "model.safetensors.index.json"]
BIN_PATTERNS = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]
PROBE_TIMEOUT_S = 5.0


def hub_unreachable() -> str | None:
    """Why the Hub cannot be asked from here, found in at most PROBE_TIMEOUT_S (None: it can be)."""
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set, so only the local cache is read"
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=PROBE_TIMEOUT_S).close()
    except OSError as e:
        return f"{url.hostname} cannot be reached ({e.strerror or e}); set HF_HUB_OFFLINE=1 to use the cache alone"
    return None


def cached_or_reachable(spec: str, fetch):
    """`fetch(local_files_only)`: from the local cache if it holds the files, else from the Hub if it can be
    reached; an unreachable Hub is a CheckpointError at once."""
    try:
        return fetch(True)
    except Exception:  # noqa: BLE001 - not (all) in the cache: ask the Hub below
        pass
    why = hub_unreachable()
    if why is not None:
        raise CheckpointError(f"{spec}: not a local folder nor in the local Hugging Face cache, and {why}")
    return fetch(False)


def resolve_hf_source(spec: str | Path, weights: bool = True) -> Path:
    """A local folder for `spec` (a folder, or a Hub id downloaded/cached by huggingface_hub)."""
    path = Path(spec)
    if path.is_dir():
        return path
    text = str(spec)
    if path.exists() or path.is_absolute() or text.startswith((".", "~")) or not REPO_ID.match(text):
        raise CheckpointError(f"{spec}: no such folder")
    def fetch(local_files_only: bool) -> Path:
        safetensors = SAFE_PATTERNS if weights else []
        folder = Path(snapshot_download(repo_id=text, allow_patterns=SIDE_PATTERNS + safetensors,
                                        local_files_only=local_files_only))
        if weights and not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(repo_id=text, allow_patterns=SIDE_PATTERNS + BIN_PATTERNS,
                                            local_files_only=local_files_only))
        return folder

    try:
        folder = cached_or_reachable(text, fetch)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - every Hub failure becomes one clear line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(
            f"{spec}: not a local folder, and fetching it from the Hub failed ({type(e).__name__}: {first})"
        ) from e
    return folder
