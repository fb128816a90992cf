"""Every input of a run opened and checked before anything is written to `--out`.

A run that fails at start-up must leave `--out` as it was: no lock, no `config.yaml`, no `hf_source/`, no
metrics file. The lock is the first thing a run writes, so what can be checked without building the model
is checked before it, on every rank, and agreed (`parallel.agree`: one line from rank 0, exit 2 everywhere):

1. the model's `config.json`, through the guarded load (`config.load_hf_config`: any error transformers
   raises becomes one line naming the file and field) and hfmeg's own reading of it (`families`);
2. its tokenizer;
3. every data source, training and eval: opened, its first records read, and with `data.bad_data: fail`
   the first window of records formatted (`data.preflight`). A Hub dataset is opened here, before the
   model's weights are loaded; where the Hub cannot be reached (and `HF_HUB_OFFLINE` is not set, with
   which `datasets` answers from its cache or fails at once), that is one line after one probe
   (`hub_unreachable`, a few seconds at most) instead of `datasets`' half a minute of retries.

What needs the model's weights (their shapes against the layout) is found while the model is built, after
the lock; the trainer then removes what start-up wrote (`Trainer._start`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

from huggingface_hub import constants

from ..checkpoint.hub_source import hub_unreachable, resolve_hf_source
from ..checkpoint.mp_layout import HF_DIR, is_mp_folder, resolve_iteration_dir
from ..config import load_hf_config
from ..data.preflight import check_sources
from ..data.sources import local_files
from ..errors import CheckpointError, DataError, HfmegError
from ..families import model_config_from_hf
from ..parallel.agree import agree
from .config import TrainConfig


def side_folder(cfg: TrainConfig) -> Path:
    """The folder of the model's config and tokenizer: an hfmeg shard folder's `hf/`, or the HF model's (from
    the Hub's cache or the Hub, without its weights)."""
    m = cfg.model
    if m.init != "random" and is_mp_folder(Path(m.path)):
        return resolve_iteration_dir(Path(m.path)) / HF_DIR
    return resolve_hf_source(m.source, weights=False)


def load_tokenizer(folder: Path):
    """The tokenizer of `folder`, or one line saying why it does not load."""
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - tokenizers and transformers raise many kinds; the user's files, named
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{folder}: the tokenizer does not load ({type(e).__name__}: {first[:200]})") from e


def check_hub_data(cfg: TrainConfig) -> None:
    """One line at once for a Hub dataset when the Hub cannot be reached and the cache is not asked for."""
    hub = [s.path for s in [*cfg.data.sources, *cfg.data.eval_sources] if local_files(s.path) is None]
    if hub and not constants.HF_HUB_OFFLINE and (why := hub_unreachable()) is not None:
        raise DataError(f"data source {hub[0]}: a Hub dataset, and {why}")


def check_inputs(cfg: TrainConfig, device: torch.device) -> None:
    """Collective: the checks above, agreed over the world."""
    error = None
    try:
        check_hub_data(cfg)
        folder = side_folder(cfg)
        model_config_from_hf(load_hf_config(folder))
        check_sources(cfg.data, load_tokenizer(folder))
    except HfmegError as e:
        error = e
    agree(error, device)
