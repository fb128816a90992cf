"""Cards after the documented SFT -> DPO flow: the base named by its run and the Hub id it came from, local data
named with its record count, the prompt format of string pairs as it is."""

from __future__ import annotations


from hfmeg.data import DataConfig, SourceConfig
from hfmeg.hub import write_model_card
from hfmeg.train.config import TrainConfig
from hfmeg.train.export import prompt_format
from test_data import char_tokenizer, write_jsonl


def test_a_card_names_an_sft_export_base_by_its_run_and_its_hub_ancestor_and_local_data_by_size(tmp_path):
    sft = tmp_path / "stories-sft" / "hf"
    sft.mkdir(parents=True)
    write_model_card(sft, base_model="org/tiny-base", data=["org/sft-set"], config={}, metrics={"loss": 1.0})
    data = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}] * 3)
    out = tmp_path / "dpo"
    out.mkdir()
    card = write_model_card(out, base_model=str(sft), data=[str(data), "org/more"], config={},
                            metrics={"loss": 0.5}).read_text()
    assert "# stories-sft fine-tuned" in card and "# hf fine-tuned" not in card
    assert "base_model: org/tiny-base" in card and "base_model_relation: finetune" in card
    assert "Fine-tuned from **stories-sft** (a local fine-tune of **org/tiny-base**" in card
    assert "- `pairs.jsonl` (local, 3 records)" in card and "- `org/more`" in card
    assert str(tmp_path) not in card  # no local path leaks


def test_string_preference_pairs_are_described_as_used(tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}])
    cfg = TrainConfig(data=DataConfig(sources=[SourceConfig(str(data))], format="preference"))
    template, said = prompt_format(cfg, char_tokenizer())
    assert template is None and said.startswith("preference pairs used as their texts are")
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "p"}],
                                                  "chosen": [{"role": "assistant", "content": "a"}],
                                                  "rejected": [{"role": "assistant", "content": "b"}]}])
    cfg = TrainConfig(data=DataConfig(sources=[SourceConfig(str(chat))], format="preference"))
    assert "chat template" in prompt_format(cfg, char_tokenizer())[1]
