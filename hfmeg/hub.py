"""Model card and Hub upload for an exported HF folder.

The card is written to be published: its title is the Hub repo's name when pushing
(else the base model's name + "fine-tuned"); the base model and the datasets appear
as Hub ids when they came from the Hub (and then in the front matter the Hub links),
local paths only by their final name, so no absolute local path is ever written; the
license is carried from the base model's own card or config when one is known
locally (no network). A run that diverged is marked as such and its numbers are not
presented as a result.

The upload goes through `huggingface_hub.HfApi` (`create_repo` + `upload_folder`).
The token is whatever huggingface_hub finds (`HF_TOKEN`, `huggingface-cli login`
cache); hfmeg never reads, logs or writes it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import HfApi, try_to_load_from_cache

from .checkpoint.hub_source import REPO_ID

# huggingface_hub's cache layout: .../models--<org>--<name>/snapshots/<commit>/
_CACHED_SNAPSHOT = re.compile(r"(?:models|datasets)--(.+?)--(.+)")


def _is_local(path: str) -> bool:
    return Path(path).exists() or path.startswith(("/", ".", "~")) or any(c in path for c in "*?[")


def hub_id(path: str) -> str | None:
    """`path` as a Hub id: itself when it is one, the repo of a Hub cache snapshot folder, else None."""
    if not _is_local(path) and REPO_ID.match(path):
        return path
    for part in reversed(Path(path).parts):
        if m := _CACHED_SNAPSHOT.fullmatch(part):
            return f"{m[1]}/{m[2]}"
    return None


def public_name(path: str) -> str:
    """What a card may say about `path`: its Hub id, else only its final name (never a local path)."""
    return hub_id(path) or Path(path).name or path


def _front_matter(text: str) -> dict[str, Any]:
    if not text.startswith("---"):
        return {}
    try:
        data = yaml.safe_load(text.split("---", 2)[1])
    except (yaml.YAMLError, IndexError):
        return {}
    return data if isinstance(data, dict) else {}


def base_license(base_model: str) -> str | None:
    """The base model's license from its local (or locally cached) card or config.json; None when unknown."""
    local = Path(base_model)
    repo = hub_id(base_model)
    for name in ("README.md", "config.json"):
        candidates = [local / name] if local.is_dir() else []
        if repo:
            cached = try_to_load_from_cache(repo, name)
            if isinstance(cached, str):
                candidates.append(Path(cached))
        for path in candidates:
            try:
                text = path.read_text()
                found = _front_matter(text) if name == "README.md" else json.loads(text)
            except (OSError, ValueError):
                continue
            if isinstance(found.get("license"), str):
                return found["license"]
    return None


def _public_config(value: Any) -> Any:
    """The config with every local path reduced to its final name."""
    if isinstance(value, dict):
        return {k: _public_config(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_public_config(v) for v in value]
    if isinstance(value, str) and ("/" in value or value.startswith("~")) and _is_local(value):
        return public_name(value)
    return value


def _cell(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def write_model_card(folder: Path, *, base_model: str, data: list[str], config: dict[str, Any],
                     metrics: dict[str, Any], repo_id: str | None = None, diverged: bool = False,
                     from_scratch: bool = False, adapter: bool = False) -> Path:
    """Write `README.md` with YAML front matter the Hub understands, plus the run's facts.

    `repo_id`: the Hub repo being pushed to (its name is the title); `diverged`: the run
    stopped on non-finite gradients (so does a non-finite final loss); `from_scratch`: the
    weights started random, and `base_model` only gave the architecture and tokenizer, so
    it is named as such and claimed neither as the base model nor for its license; `adapter`: the
    folder is a PEFT adapter (LoRA/DoRA) that loads onto `base_model` with `peft`."""
    base = public_name(base_model)
    datasets = [d for d in dict.fromkeys(hub_id(p) for p in data) if d]
    loss = metrics.get("loss")
    diverged = diverged or (isinstance(loss, float) and not math.isfinite(loss))
    meta: dict[str, Any] = {"library_name": "peft" if adapter else "transformers",
                            "tags": ["hfmeg", "pretrained-from-scratch" if from_scratch else "fine-tuned"]
                            + (["lora"] if adapter else [])}
    if hub_id(base_model) and not from_scratch:
        meta["base_model"] = hub_id(base_model)
    if datasets:
        meta["datasets"] = datasets
    if not from_scratch and (license_ := base_license(base_model)):
        meta["license"] = license_
    title = (repo_id or f"{base} {'from scratch' if from_scratch else 'fine-tuned'}").split("/")[-1]
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).strip(), "---", "", f"# {title}", ""]
    if diverged:
        lines += ["> **This run diverged** (non-finite loss or gradients): these weights are a snapshot for "
                  "inspection, not a usable fine-tuned model.", ""]
    lines += [
        (f"Pretrained from random weights with the architecture and tokenizer of **{base}**, "
         if from_scratch else f"Fine-tuned from **{base}** ") + "with hfmeg "
        "(Megatron-style TP/SP/PP with an overlapped distributed optimizer).",
        "",
        "## Data",
        *[f"- `{public_name(d)}`" for d in data],
        "",
        "## Metrics at the last step" + (" (diverged: not a result)" if diverged else ""),
        "",
        "| metric | value |",
        "|---|---|",
        *[f"| {k} | {_cell(v)} |" for k, v in metrics.items()],
        "",
        "## Training configuration",
        "",
        "```json",
        json.dumps(_public_config(config), indent=2, default=str),
        "```",
        "",
        "## Use",
        "",
        "```python",
        *(_adapter_use(base_model, repo_id) if adapter else [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            f'model = AutoModelForCausalLM.from_pretrained("{repo_id or "<this folder>"}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{repo_id or "<this folder>"}")']),
        "```",
        "",
    ]
    path = folder / "README.md"
    path.write_text("\n".join(lines))
    return path


def _adapter_use(base_model: str, repo_id: str | None) -> list[str]:
    base = hub_id(base_model) or "<the base model's folder>"
    return ["from peft import PeftModel",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            f'base = AutoModelForCausalLM.from_pretrained("{base}")',
            f'model = PeftModel.from_pretrained(base, "{repo_id or "<this folder>"}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{base}")']


def push_to_hub(folder: Path, repo_id: str, *, private: bool = False, api: HfApi | None = None,
                commit_message: str = "Upload model trained with hfmeg") -> str:
    """Create `repo_id` if needed and upload `folder`; returns the commit URL."""
    api = api or HfApi()
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    info = api.upload_folder(repo_id=repo_id, repo_type="model", folder_path=str(folder),
                             commit_message=commit_message)
    return str(getattr(info, "commit_url", info))
