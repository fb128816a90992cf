"""A LoRA run's exports as a user meets them after training (issue 33).

- The adapter folder names its base by absolute path (the run named it relative to its working directory), so
  moved elsewhere it loads with `AutoPeftModelForCausalLM` from any directory, computing what the merged `hf/` does.
- A base from the Hub (here a folder of huggingface_hub's cache, as `snapshot_download` leaves it) is named by its
  Hub id: in the pushed adapter config (a stand-in for `HfApi` records the upload), in both cards' metadata as
  `huggingface_hub.ModelCard` reads it, and the adapter loads onto it through the cache.
- The base has no chat template, so the run trained with hfmeg's default: the exported tokenizer carries it and
  `apply_chat_template` renders a record exactly as training did.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import ModelCard
from bounds import within
from peft import AutoPeftModelForCausalLM
from peft_helpers import peft_logit_bound
from test_peft_train import ALPACA, _config
from test_train import _run
from transformers import AutoModelForCausalLM, AutoTokenizer

from hfmeg.data import SourceConfig
from hfmeg.data.formats import Formatter
from hfmeg.parallel.launch import spawn
from hfmeg.peft.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from hfmeg.peft.export import read_info
from hfmeg.train.dataclass_io import ConfigError
from hfmeg.train.validate import validate

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the cache's snapshot folder is named by its commit
IDS = torch.tensor([[1, 365, 1122, 263, 931, 29892, 727, 471]]) % 512  # stories260K has 512 tokens


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def test_a_moved_adapter_loads_from_another_directory(stories_lora, tmp_path, monkeypatch):
    base, adapter0 = stories_lora
    shutil.copytree(base, tmp_path / "models" / "stories260K")
    monkeypatch.chdir(tmp_path)
    spawn(_run, 1, _config(Path("run"), Path("models/stories260K"), adapter0, steps=3))  # as typed: relative
    run = Path.cwd() / "run"
    config = json.loads((run / "adapter" / CONFIG_FILE).read_text())
    assert config["base_model_name_or_path"] == str(Path.cwd() / "models" / "stories260K")
    ckpt = sorted((run / "checkpoints").glob("iter_*"))[-1]  # so the converters find the base from anywhere too
    assert read_info(ckpt)[1]["path"] == config["base_model_name_or_path"]
    moved = tmp_path / "elsewhere" / "my-adapter"
    shutil.move(run / "adapter", moved)
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")
    with_adapter = _logits(AutoPeftModelForCausalLM.from_pretrained(moved, dtype=torch.float32))
    merged = _logits(AutoModelForCausalLM.from_pretrained(run / "hf", dtype=torch.float32))
    plain = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "models" / "stories260K", dtype=torch.float32))
    assert (with_adapter - plain).abs().max() > 1e-3, "three steps must move the adapter for the test to bite"
    # fp32 logits of a 5-layer model, merged vs added: within rounding of peft's own distance from float64
    bound = peft_logit_bound(tmp_path / "models" / "stories260K", moved, IDS, with_adapter)
    within((with_adapter - merged).abs().max().item(), bound, "merged vs peft logits max-abs")


class _HubStandIn:
    """Records `HfApi`'s calls, and the adapter config as uploaded."""

    calls: list = []

    def create_repo(self, **kwargs):
        self.calls.append({"call": "create_repo", **kwargs})

    def upload_folder(self, **kwargs):
        folder = Path(kwargs["folder_path"])
        self.calls.append({"call": "upload_folder", **kwargs, "files": sorted(p.name for p in folder.iterdir()),
                           "adapter_config": json.loads((folder / CONFIG_FILE).read_text())})
        return "https://huggingface.co/me/stories-lora/commit/0"


def _run_pushing(cfg):
    """The run, in its rank, with the stand-in for the Hub (so also under the `spawn` start method)."""
    import hfmeg.hub

    hfmeg.hub.HfApi = _HubStandIn
    _run(cfg)
    return _HubStandIn.calls


def _hub_cache(root: Path, kind: str, repo: str, source: Path) -> Path:
    """`source` (a folder or file) as huggingface_hub's cache holds a snapshot of `kind` repo `repo`."""
    top = root / f"{kind}s--{repo.replace('/', '--')}"
    (top / "refs").mkdir(parents=True)
    (top / "refs" / "main").write_text(COMMIT)
    snap = top / "snapshots" / COMMIT
    if source.is_dir():
        shutil.copytree(source, snap)
        return snap
    snap.mkdir(parents=True)
    return Path(shutil.copy(source, snap))


def test_a_hub_base_is_named_by_its_id_in_the_pushed_adapter_and_the_cards(stories_lora, tmp_path, monkeypatch):
    base, adapter0 = stories_lora
    cache = tmp_path / "hub"
    snap = _hub_cache(cache, "model", "hfmeg-test/stories260K", base)
    (snap / "README.md").write_text("---\nlicense: mit\n---\n# stories260K\n")
    data = _hub_cache(cache, "dataset", "hfmeg-test/alpaca", ALPACA)
    cfg = _config(tmp_path / "run", snap, adapter0, steps=2)
    cfg.data.sources = [SourceConfig(str(data))]
    cfg.hub.push_to_hub = "me/stories-lora"
    calls = spawn(_run_pushing, 1, cfg)[0]
    run = tmp_path / "run"

    assert [c["call"] for c in calls] == ["create_repo", "upload_folder"]
    upload = calls[1]
    assert Path(upload["folder_path"]) == run / "adapter" and upload["repo_id"] == "me/stories-lora"
    assert {"README.md", CONFIG_FILE, WEIGHTS_FILE} <= set(upload["files"])
    assert upload["adapter_config"]["base_model_name_or_path"] == "hfmeg-test/stories260K"

    hf = ModelCard.load(run / "hf" / "README.md").data
    assert (hf.base_model, hf.base_model_relation, hf.datasets, hf.license, hf.pipeline_tag, hf.library_name) == (
        "hfmeg-test/stories260K", "finetune", ["hfmeg-test/alpaca"], "mit", "text-generation", "transformers")
    card = ModelCard.load(run / "adapter" / "README.md")
    assert (card.data.base_model, card.data.base_model_relation, card.data.library_name) == (
        "hfmeg-test/stories260K", "adapter", "peft")
    assert "- method: LoRA (r 4, alpha 8, dropout 0) on " in card.text and "- dtype: fp32" in card.text
    assert "- layout: TP 1 × PP 1 × DP 1 × CP 1; optimizer mode overlapped" in card.text
    assert "- prompt format: hfmeg's default chat template" in card.text
    assert 'PeftModel.from_pretrained(base, "me/stories-lora")' in card.text

    # as someone who downloaded the adapter: its base found by Hub id (in the cache: this test is offline)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # else transformers asks the Hub too
    AutoPeftModelForCausalLM.from_pretrained(run / "adapter", cache_dir=str(cache), local_files_only=True)

    tok = AutoTokenizer.from_pretrained(run / "hf")
    assert json.loads((run / "hf" / "tokenizer_config.json").read_text())["tokenizer_class"] != "TokenizersBackend"
    fmt, (_, fields) = Formatter(cfg.data, AutoTokenizer.from_pretrained(snap)), cfg.data.fields_of(cfg.data.sources[0])
    for rec in json.loads(data.read_text())[:4]:
        user = rec["instruction"] + (f"\n\n{rec['input']}" if rec.get("input", "").strip() else "")
        chat = [{"role": "user", "content": user}, {"role": "assistant", "content": rec["output"]}]
        assert tok.apply_chat_template(chat, tokenize=False) == fmt.render(rec, "alpaca", fields).text


def test_pushing_an_adapter_of_a_local_base_is_refused_at_start(stories_lora, tmp_path):
    """The pushed adapter would name a folder no one else has: one line before any work, not after training."""
    base, adapter0 = stories_lora
    cfg = _config(tmp_path / "run", base, adapter0)
    cfg.hub.push_to_hub = "me/stories-lora"
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=1)
    assert str(e.value) == (f"hub.push_to_hub: a LoRA run pushes its adapter, which must name its base by Hub id, but "
                            f"model.path {base} is a local folder; give model.path as the base's Hub id")
