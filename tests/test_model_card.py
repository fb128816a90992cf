"""The model card is fit to publish (issue 18 #12): title, base model, datasets, license, no local paths."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from hfmeg.hub import write_model_card


def _card(folder: Path, **kwargs) -> tuple[dict, str]:
    folder.mkdir(parents=True, exist_ok=True)
    text = write_model_card(folder, **kwargs).read_text()
    return yaml.safe_load(text.split("---")[1]), text


def test_local_base_model_and_data_by_name_only_with_their_license(tmp_path):
    base = tmp_path / "models" / "stories260K"
    base.mkdir(parents=True)
    (base / "README.md").write_text("---\nlicense: mit\n---\n# stories\n")
    data = str(tmp_path / "data" / "alpaca_en_demo.json")
    config = {"model": {"path": str(base)}, "data": {"sources": [{"path": data}]},
              "checkpoint": {"out": str(tmp_path / "out" / "run")}, "optim": {"lr": 0.001}}
    meta, text = _card(tmp_path / "out" / "run" / "hf", base_model=str(base), data=[data], config=config,
                       metrics={"step": 30, "loss": 2.5})
    assert meta == {"library_name": "transformers", "tags": ["hfmeg", "fine-tuned"], "license": "mit"}
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
