"""The model card is fit to publish (issues 18 #12, 33): title, the Hub's metadata (base model and relation,
datasets, license, pipeline, library) as `huggingface_hub.ModelCard` parses it, the training method,
layout and dtype, no local paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from huggingface_hub.utils import validate_repo_id

from hfmeg.hub import PushRefused, push_to_hub, write_model_card
from hfmeg.peft.config import PeftConfig


def _card(folder: Path, **kwargs) -> tuple[dict, str]:
    """The card's metadata as huggingface_hub reads it (Hub ids checked as the Hub would, offline), and its text."""
    folder.mkdir(parents=True, exist_ok=True)
    path = write_model_card(folder, **kwargs)
    meta = ModelCard.load(path).data.to_dict()
    for repo in [meta.get("base_model"), *meta.get("datasets", [])]:
        if repo:
            validate_repo_id(repo)
    return meta, path.read_text()


def test_local_base_model_and_data_by_name_only_with_their_license(tmp_path):
    base = tmp_path / "models" / "stories260K"
    base.mkdir(parents=True)
    (base / "README.md").write_text("---\nlicense: mit\n---\n# stories\n")
    data = str(tmp_path / "data" / "alpaca_en_demo.json")
    config = {"model": {"path": str(base)}, "data": {"sources": [{"path": data}]},
              "checkpoint": {"out": str(tmp_path / "out" / "run")}, "optim": {"lr": 0.001}}
    meta, text = _card(tmp_path / "out" / "run" / "hf", base_model=str(base), data=[data], config=config,
                       metrics={"step": 30, "loss": 2.5})
    # a local base has no Hub id: no base_model (the Hub would reject a folder name there), said in the body
    assert meta == {"library_name": "transformers", "tags": ["hfmeg", "fine-tuned"], "license": "mit",
                    "pipeline_tag": "text-generation"}
    assert "**stories260K** (a local folder, not a Hub repo, so no `base_model` is declared)" in text
    assert "\n# stories260K fine-tuned\n" in text  # was "# run", the --out folder's name
    assert "- `alpaca_en_demo.json`" in text
    assert str(tmp_path) not in text  # nothing local is published
    shown = json.loads(text.split("```json")[1].split("```")[0])
    assert shown["model"]["path"] == "stories260K" and shown["checkpoint"]["out"] == "run"
    assert shown["optim"]["lr"] == 0.001


def test_hub_base_model_and_datasets_in_the_front_matter(tmp_path):
    meta, text = _card(tmp_path / "hf", base_model="meta-llama/Llama-2-7b-hf",
                       data=["tatsu-lab/alpaca", "tatsu-lab/alpaca", str(tmp_path / "extra.jsonl")], config={},
                       metrics={"loss": 1.25}, repo_id="me/llama2-alpaca")
    assert meta["base_model"] == "meta-llama/Llama-2-7b-hf" and meta["datasets"] == ["tatsu-lab/alpaca"]
    assert meta["base_model_relation"] == "finetune" and meta["library_name"] == "transformers"
    assert "\n# llama2-alpaca\n" in text and 'from_pretrained("me/llama2-alpaca")' in text
    assert "This run diverged" not in text
    # hfmeg is not on a package index and has no public page: the card names it without a link that would 404
    assert "with hfmeg (Megatron-style" in text and "](http" not in text.split("## Data")[0]


def test_a_hub_cache_snapshot_is_named_by_its_repo(tmp_path):
    snap = tmp_path / "hub" / "models--Qwen--Qwen2-0.5B" / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"license": "apache-2.0"}))
    meta, text = _card(tmp_path / "hf", base_model=str(snap), data=[], config={}, metrics={})
    assert meta["base_model"] == "Qwen/Qwen2-0.5B" and meta["license"] == "apache-2.0"
    assert "\n# Qwen2-0.5B fine-tuned\n" in text and str(tmp_path) not in text


def test_a_diverged_run_is_not_presented_as_a_result(tmp_path):
    for kwargs in ({"diverged": True, "metrics": {"loss": 3.0}}, {"metrics": {"loss": float("nan")}}):
        _, text = _card(tmp_path / "hf", base_model="m/x", data=[], config={}, **kwargs)
        assert "> **This run diverged**" in text and "## Metrics at the last step (diverged: not a result)" in text


def test_an_adapter_card_says_peft_and_the_training_facts(tmp_path):
    config = {"model": {"path": "m/base", "dtype": "auto"}, "peft": {"method": "lora", "r": 99}}
    peft = PeftConfig(method="dora", r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    meta, text = _card(tmp_path / "adapter", base_model="m/base", data=[], config=config, metrics={},
                       adapter=True, peft=peft, dtype="fp32", prompt_format="the base tokenizer's own chat template",
                       layout=dict(tp=2, pp=2, dp=1, cp=1, ep=1, sequence_parallel=True, optimizer="overlapped"))
    assert meta["library_name"] == "peft" and meta["base_model_relation"] == "adapter" and "dora" in meta["tags"]
    assert meta["pipeline_tag"] == "text-generation" and meta["base_model"] == "m/base"
    # the effective settings (an init_from adapter's, not the config's r), the layout and the dtype trained
    assert "- method: DoRA (r 4, alpha 8, dropout 0) on q_proj, v_proj; the base weights frozen" in text
    assert "- layout: TP 2 × PP 2 × DP 1 × CP 1, sequence parallel; optimizer mode overlapped" in text
    assert "- dtype: fp32" in text and "- prompt format: the base tokenizer's own chat template" in text
    shown = json.loads(text.split("```json")[1].split("```")[0])
    assert shown["model"]["dtype"] == "fp32"


def test_from_scratch_claims_no_base(tmp_path):
    meta, text = _card(tmp_path / "hf", base_model="m/base", data=["org/corpus"], config={}, metrics={},
                       from_scratch=True)
    assert "base_model" not in meta and "base_model_relation" not in meta and meta["datasets"] == ["org/corpus"]
    assert "- method: pretraining from random weights" in text


class _Recorder:
    """A stand-in for `huggingface_hub.HfApi` that records the calls it gets."""

    def __init__(self):
        self.calls = []

    def create_repo(self, **kwargs):
        self.calls.append(("create_repo", kwargs))

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))


def test_an_adapter_naming_a_local_base_is_not_pushed(tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "base")}))
    api = _Recorder()
    with pytest.raises(PushRefused, match="adapter_config.json: base_model_name_or_path .* is not a Hub id"):
        push_to_hub(folder, "me/x", api=api)
    assert api.calls == []


def test_an_fp8_run_card_names_the_recipe_and_the_saved_dtype(tmp_path):
    _, text = _card(tmp_path / "hf", base_model="m/x", data=[], config={}, metrics={}, dtype="bf16", fp8="rowwise")
    assert "- FP8 compute: torchao's `rowwise` recipe on the linears' GEMMs; the weights are saved in the master " \
           "dtype" in text
    _, text = _card(tmp_path / "plain", base_model="m/x", data=[], config={}, metrics={}, dtype="bf16")
    assert "FP8" not in text
