"""`--model`: a built-in name, an HF folder, a bare `config.json`, or a Hub id (its config.json only).

The built-in configs need no download: the issue's seed model (a GPT with hidden
3072, 32 layers, 32 heads, vocabulary 50264, seq 1024: 3.6B parameters) and the
LLaMA-2 7B/13B/70B shapes. A Hub id fetches `config.json` alone through
`huggingface_hub` (cache and `HF_HUB_OFFLINE` honoured): planning needs no weights
(`checkpoint.hub_source` would fetch them too). What `model_config_from_hf` refuses
(an architecture hfmeg cannot run) the planner refuses with the same line.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig, GPT2Config, LlamaConfig

from ..checkpoint.hub_source import cached_or_reachable
from ..config import ModelConfig, load_hf_config
from ..families import model_config_from_hf
from ..errors import CheckpointError, UnsupportedConfigError

_LLAMA2 = dict(vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5)
BUILTIN = {
    "gpt-3.6b": lambda: GPT2Config(n_embd=3072, n_layer=32, n_head=32, vocab_size=50264, n_positions=1024),
    "llama2-7b": lambda: LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                     num_attention_heads=32, **_LLAMA2),
    "llama2-13b": lambda: LlamaConfig(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                                      num_attention_heads=40, **_LLAMA2),
    "llama2-70b": lambda: LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                      num_attention_heads=64, num_key_value_heads=8, **_LLAMA2),
}


def _from_json(path: Path):
    try:
        raw = json.loads(path.read_text())
        model_type = raw.pop("model_type")
        return AutoConfig.for_model(model_type, **raw)
    except (OSError, ValueError, KeyError) as e:
        raise UnsupportedConfigError(f"{path}: not a usable config.json ({type(e).__name__}: {e})") from e


def _from_hub(repo_id: str):
    from huggingface_hub import hf_hub_download

    def fetch(local_files_only: bool) -> Path:
        return Path(hf_hub_download(repo_id, "config.json", local_files_only=local_files_only))

    try:
        return _from_json(cached_or_reachable(f"--model {repo_id}", fetch))
    except UnsupportedConfigError:
        raise
    except CheckpointError as e:  # the Hub cannot be reached: say what would have worked instead
        raise UnsupportedConfigError(f"{e}; built-in names: {', '.join(BUILTIN)}") from None
    except Exception as e:  # noqa: BLE001 - every Hub failure becomes one clear line
        first = (str(e).strip().splitlines() or [""])[0]
        raise UnsupportedConfigError(f"--model {repo_id}: not a built-in name ({', '.join(BUILTIN)}), folder or "
                                     f"file, and fetching its config.json failed ({type(e).__name__}: {first})") from e


def resolve_model(spec: str) -> ModelConfig:
    if spec in BUILTIN:
        return model_config_from_hf(BUILTIN[spec]())
    path = Path(spec)
    if path.is_dir():
        return model_config_from_hf(load_hf_config(path))
    if path.is_file():
        return model_config_from_hf(_from_json(path))
    if path.is_absolute() or spec.startswith((".", "~")) or spec.endswith(".json"):
        raise UnsupportedConfigError(f"--model {spec}: no such folder or file")
    return model_config_from_hf(_from_hub(spec))
