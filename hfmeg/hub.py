"""Model card and Hub upload for an exported HF folder.

The upload goes through `huggingface_hub.HfApi` (`create_repo` + `upload_folder`).
The token is whatever huggingface_hub finds (`HF_TOKEN`, `huggingface-cli login`
cache); hfmeg never reads, logs or writes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi


def write_model_card(folder: Path, *, base_model: str, data: list[str], config: dict[str, Any],
                     metrics: dict[str, Any]) -> Path:
    """Write `README.md` with YAML front matter the Hub understands, plus the run's facts."""
    lines = [
        "---",
        "library_name: transformers",
        "tags: [hfmeg, fine-tuned]",
    ]
    if base_model and not Path(base_model).exists():
        lines.append(f"base_model: {base_model}")
    lines += ["---", "", f"# {folder.parent.name or 'hfmeg model'}", ""]
    lines += [
        f"Fine-tuned from **{base_model}** with [hfmeg](https://pypi.org/project/hfmeg/) "
        "(Megatron-style TP/SP/PP with an overlapped distributed optimizer).",
        "",
        "## Data",
        *[f"- `{d}`" for d in data],
        "",
        "## Final metrics",
        "",
        "| metric | value |",
        "|---|---|",
        *[f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in metrics.items()],
        "",
        "## Training configuration",
        "",
        "```json",
        json.dumps(config, indent=2, default=str),
        "```",
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("<this repo or folder>")',
        'tokenizer = AutoTokenizer.from_pretrained("<this repo or folder>")',
        "```",
        "",
    ]
    path = folder / "README.md"
    path.write_text("\n".join(lines))
    return path


def push_to_hub(folder: Path, repo_id: str, *, private: bool = False, api: HfApi | None = None,
                commit_message: str = "Upload model trained with hfmeg") -> str:
    """Create `repo_id` if needed and upload `folder`; returns the commit URL."""
    api = api or HfApi()
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    info = api.upload_folder(repo_id=repo_id, repo_type="model", folder_path=str(folder),
                             commit_message=commit_message)
    return str(getattr(info, "commit_url", info))
