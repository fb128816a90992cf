"""Model card and Hub upload for an exported HF folder.

The card is written to be published: its title is the Hub repo's name when pushing
(else the base model's name + "fine-tuned"); its front matter is `huggingface_hub.ModelCardData`
(the Hub's field names): `base_model` and `base_model_relation` (finetune / adapter) when the base
has a Hub id (a local folder has none, and the Hub accepts only repo ids there), the datasets
with Hub ids, the base's license when one is known locally (no network), `pipeline_tag` and
`library_name`. Local paths appear only by their final name, so no absolute local path is ever
written. The text says how the run trained (method, layout, dtype, prompt format) and what it
measured; a run that diverged is marked as such and its numbers are not presented as a result.

The upload goes through `huggingface_hub.HfApi` (`create_repo` + `upload_folder`).
The token is whatever huggingface_hub finds (`HF_TOKEN`, `hf auth login`
cache); hfmeg never reads, logs or writes it. An adapter is pushed only when it names its base by Hub id.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import HfApi, ModelCardData, try_to_load_from_cache

from .checkpoint.hub_ids import hub_id, is_local
from .errors import HfmegError


EXPORT_FOLDERS = ("hf", "adapter")  # where a run writes its exports (<out>/hf, <out>/adapter)


def public_name(path: str) -> str:
    """What a card may say about `path`: its Hub id, else only its final name (never a local path); an hfmeg
    export (`<out>/hf`) by its run's folder name, which is what names it."""
    if hub_id(path):
        return hub_id(path)
    p = Path(path).resolve() if Path(path).exists() else Path(path)
    return (p.parent.name if p.name in EXPORT_FOLDERS and p.parent.name else p.name) or path


def trained_from(base_model: str) -> str | None:
    """The Hub id a local base was itself trained from, as its card's front matter declares (an hfmeg SFT export
    fine-tuned from a Hub model); None for a Hub base or a folder without one."""
    if hub_id(base_model) or not (Path(base_model) / "README.md").is_file():
        return None
    found = _front_matter((Path(base_model) / "README.md").read_text()).get("base_model")
    return found if isinstance(found, str) and hub_id(found) == found else None


def data_name(path: str) -> str:
    """A data source as a card names it: a Hub id as it is, a local one by its file name and record count."""
    if hub_id(path):
        return f"`{hub_id(path)}`"
    from .data.sources import Table, local_files

    try:
        return f"`{Path(path).name}` (local, {len(Table(local_files(path) or [])):,} records)"
    except (HfmegError, OSError, ValueError):
        return f"`{Path(path).name}` (local)"


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
    if isinstance(value, str) and ("/" in value or value.startswith("~")) and is_local(value):
        return public_name(value)
    return value


def _cell(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _method(peft: Any, from_scratch: bool) -> str:
    """The training method in words: `peft` is the run's effective `PeftConfig` (None: every weight trained)."""
    if peft is None:
        return "pretraining from random weights" if from_scratch else "full fine-tuning (every weight trained)"
    name = "DoRA" if peft.method == "dora" else "LoRA"
    extras = ", rsLoRA" if peft.use_rslora else ""
    extras += f", modules saved whole: {', '.join(peft.modules_to_save)}" if peft.modules_to_save else ""
    frozen = "the base weights frozen"
    if getattr(peft, "quantize", None):  # QLoRA: the settings of transformers' BitsAndBytesConfig it matches
        name = "Q" + name
        frozen += (f", stored 4-bit by bitsandbytes ({peft.quantize}, double quantization "
                   f"{'on' if peft.double_quant else 'off'}, compute dtype {peft.compute_dtype or 'the run dtype'})")
    return (f"{name} (r {peft.r}, alpha {peft.alpha:g}, dropout {peft.dropout:g}{extras}) on "
            f"{', '.join(peft.target_modules)}; {frozen}")


def _layout(layout: dict[str, Any]) -> str:
    """`{"tp", "pp", "dp", "cp", "ep", "sequence_parallel", "optimizer"}` in words."""
    grid = " × ".join(f"{k.upper()} {layout[k]}" for k in ("tp", "pp", "dp", "cp") if k in layout)
    extras = [f"EP {layout['ep']}"] if layout.get("ep", 1) > 1 else []
    # sequence parallelism splits the TP regions' activations: a run at TP 1 has none to split
    extras += ["sequence parallel"] if layout.get("sequence_parallel") and layout.get("tp", 1) > 1 else []
    return ", ".join([grid, *extras]) + (f"; optimizer mode {layout['optimizer']}" if "optimizer" in layout else "")


def _card_metadata(*, base_model: str, data: list[str], from_scratch: bool, adapter: bool,
                  method: str = "lora", tags: tuple[str, ...] = ()) -> ModelCardData:
    """The front matter the Hub reads: base model and relation (it builds the model tree from them), data sets,
    license, pipeline and library (`huggingface_hub.ModelCardData`, so the Hub's own field names)."""
    base = None if from_scratch else hub_id(base_model) or trained_from(base_model)
    datasets = [d for d in dict.fromkeys(hub_id(p) for p in data) if d]
    return ModelCardData(
        base_model=base, base_model_relation=("adapter" if adapter else "finetune") if base else None,
        datasets=datasets or None, license=None if from_scratch else base_license(base_model),
        pipeline_tag="text-generation", library_name="peft" if adapter else "transformers",
        tags=["hfmeg", "pretrained-from-scratch" if from_scratch else "fine-tuned"] + ([method] if adapter else [])
        + list(tags))


def write_model_card(folder: Path, *, base_model: str, data: list[str], config: dict[str, Any],
                     metrics: dict[str, Any], repo_id: str | None = None, diverged: bool = False,
                     from_scratch: bool = False, adapter: bool = False, peft: Any = None,
                     layout: dict[str, Any] | None = None, dtype: str | None = None,
                     prompt_format: str | None = None, objective: str | None = None,
                     tags: tuple[str, ...] = (), fp8: str = "off") -> Path:
    """Write `README.md` with YAML front matter the Hub understands, plus the run's facts.

    `repo_id`: the Hub repo being pushed to (its name is the title); `diverged`: the run
    stopped on non-finite gradients (so does a non-finite final loss); `from_scratch`: the
    weights started random, and `base_model` only gave the architecture and tokenizer, so
    it is named as such and claimed neither as the base model nor for its license; `adapter`: the
    folder is a PEFT adapter (LoRA/DoRA) that loads onto `base_model` with `peft`; `peft`: the run's
    effective `PeftConfig` (None: full training); `layout`: see `_layout`; `dtype`: what the run computed
    in (`config`'s `model.dtype` may say `auto`); `prompt_format`: the chat template trained with, in words;
    `objective`: what the run optimised, in words, where it is not next-token prediction (a preference loss),
    and `tags` its Hub tags (e.g. `dpo`); `fp8`: the FP8 compute recipe the linears trained with (`model.fp8`)."""
    base = public_name(base_model)
    loss = metrics.get("loss")
    diverged = diverged or (isinstance(loss, float) and not math.isfinite(loss))
    meta = _card_metadata(base_model=base_model, data=data, from_scratch=from_scratch, adapter=adapter,
                         method=getattr(peft, "method", "lora"), tags=tags)
    shown = _public_config(config)
    if dtype and isinstance(shown.get("model"), dict):
        shown["model"]["dtype"] = dtype
    title = (repo_id or f"{base} {'from scratch' if from_scratch else 'fine-tuned'}").split("/")[-1]
    lines = ["---", meta.to_yaml(), "---", "", f"# {title}", ""]
    if diverged:
        lines += ["> **This run diverged** (non-finite loss or gradients): these weights are a snapshot for "
                  "inspection, not a usable fine-tuned model.", ""]
    ancestor = trained_from(base_model)
    origin = ("" if from_scratch or hub_id(base_model)
              else f" (a local fine-tune of **{ancestor}**, declared as `base_model`)" if ancestor
              else " (a local folder, not a Hub repo, so no `base_model` is declared)")
    lines += [
        (f"Pretrained from random weights with the architecture and tokenizer of **{base}**{origin}, "
         if from_scratch else f"Fine-tuned from **{base}**{origin} ") + "with hfmeg "
        "(Megatron-style TP/SP/PP with an overlapped distributed optimizer)"
        + (f"; this folder is the {'DoRA' if getattr(peft, 'method', '') == 'dora' else 'LoRA'} adapter, "
           "loaded onto the base with `peft`." if adapter else "."),
        "",
        "## Training",
        "",
        f"- method: {_method(peft, from_scratch)}",
        *([f"- objective: {objective}"] if objective else []),
        *([f"- layout: {_layout(layout)}"] if layout else []),
        *([f"- dtype: {dtype}"] if dtype else []),
        *([f"- FP8 compute: torchao's `{fp8}` recipe on the linears' GEMMs; the weights are saved in the master "
           "dtype"] if fp8 != "off" else []),
        *([f"- prompt format: {prompt_format}"] if prompt_format else []),
        "",
        "## Data",
        *[f"- {data_name(d)}" for d in data],
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
        json.dumps(shown, indent=2, default=str),
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


class PushRefused(HfmegError):
    """The folder would be useless or leak a local path on the Hub."""


def push_to_hub(folder: Path, repo_id: str, *, private: bool = False, api: HfApi | None = None,
                commit_message: str = "Upload model trained with hfmeg") -> str:
    """Create `repo_id` if needed and upload `folder`; returns the commit URL.

    A PEFT adapter folder is refused (before anything is sent) unless its `adapter_config.json` names
    the base by Hub id: a local path would point nowhere for anyone who downloads it."""
    config = Path(folder) / "adapter_config.json"
    if config.is_file():
        base = json.loads(config.read_text()).get("base_model_name_or_path") or ""
        if hub_id(base) != base:
            raise PushRefused(f"{config}: base_model_name_or_path {base!r} is not a Hub id, so the pushed adapter "
                              "would name a base no one else can load; train on the base by its Hub id")
    api = api or HfApi()
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    info = api.upload_folder(repo_id=repo_id, repo_type="model", folder_path=str(folder),
                             commit_message=commit_message)
    return str(getattr(info, "commit_url", info))
