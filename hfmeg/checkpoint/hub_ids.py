"""How a model or data set is named so that another directory or machine finds it.

A Hub id is itself; a folder of huggingface_hub's cache (`.../models--<org>--<name>/snapshots/<commit>/`)
is its repo's id; any other local path is only meaningful on this machine, and then as an absolute path.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .hub_source import REPO_ID

# huggingface_hub's cache layout: .../models--<org>--<name>/snapshots/<commit>/
_CACHED_SNAPSHOT = re.compile(r"(?:models|datasets)--(.+?)--(.+)")


def is_local(path: str) -> bool:
    return Path(path).exists() or path.startswith(("/", ".", "~")) or any(c in path for c in "*?[")


def hub_id(path: str) -> str | None:
    """`path` as a Hub id: itself when it is one, the repo of a Hub cache snapshot folder, else None."""
    if not is_local(path) and REPO_ID.match(path):
        return path
    for part in reversed(Path(path).parts):
        if m := _CACHED_SNAPSHOT.fullmatch(part):
            return f"{m[1]}/{m[2]}"
    return None


def absolute(path: str) -> str:
    """`path` as any working directory finds it: a local path made absolute (symlinks kept), a Hub id as is."""
    return os.path.abspath(os.path.expanduser(path)) if is_local(path) else path


def portable_name(path: str) -> str:
    """`path` as any working directory or machine finds it: its Hub id, else its absolute path."""
    return hub_id(path) or absolute(path)
