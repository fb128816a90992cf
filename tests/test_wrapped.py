"""Multimodal wrapped checkpoints (`families/wrappers.py`, `checkpoint/carried.py`): tiny Gemma 3, Mistral 3 and
Gemma 4 wrappers (text model under `text_config`, a vision tower and its projector) round-trip bit-exact at TP2 and
PP2 and compute their class's logits on text; the Gemma 3 one trains 5 steps and exports a folder its own class
loads, with every non-text tensor byte-identical to the input's and the text tensors the trained ones; LoRA on a
wrapper is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from hfmeg.checkpoint.convert import hf_to_mp, mp_to_hf
from hfmeg.checkpoint.mp_reader import MPCheckpoint
from hfmeg.checkpoint.parity import reference_outputs
from hfmeg.config import load_hf_config
from hfmeg.errors import UnsupportedConfigError
from hfmeg.families.wrappers import stored_name
from hfmeg.peft.adapters import check_unwrapped
from hfmeg.peft.config import PeftConfig
from bounds import assert_close
from helpers import folder_tensors, logit_bound, make_ps
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from tiny_models import WRAPPED_KINDS, save_tiny_wrapped

TEXT = "language_model."  # the prefix save_pretrained gives Gemma 3's language model's tensors (v4 names)


def _same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    return (x.dtype, x.shape) == (y.dtype, y.shape) and torch.equal(x.contiguous().view(-1).view(torch.uint8),
                                                                    y.contiguous().view(-1).view(torch.uint8))


@pytest.mark.parametrize("kind", WRAPPED_KINDS)
def test_round_trip_is_bit_exact_at_tp2_and_pp2_and_logits_are_the_wrappers(tmp_path, kind):
    layers = {} if kind in ("mistral3", "qwen3_5", "qwen3_5_moe") else {"layer_types": ["sliding_attention", "full_attention"] * 2}
    src = save_tiny_wrapped(kind, tmp_path / "src", num_hidden_layers=4, **layers)
    before = folder_tensors(src)
    carried = HFCheckpoint(src).carried
    vision = "model.visual." if kind.startswith("qwen3_5") else "vision_tower"  # Qwen3.5's vision model is `visual`
    assert any(vision in k for k in carried) and all(k in before for k in carried)
    for tp, pp in ((2, 1), (1, 2)):
        mp, hf = tmp_path / f"mp{tp}{pp}", tmp_path / f"hf{tp}{pp}"
        hf_to_mp(src, mp, tp=tp, pp=pp)
        mp_to_hf(mp, hf)
        after = folder_tensors(hf)
        assert sorted(after) == sorted(before)
        assert [k for k in before if not _same_bytes(before[k], after[k])] == []
        assert json.loads((hf / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    # Gemma 3's class leaves the final logits uncapped (its text_config caps at 0.5); Mistral 3's ties its head by
    # the wrapper's tie_word_embeddings (true), not text_config's (false).
    # The reference is `hfmeg verify`'s: the wrapper's own class (AutoModelForImageTextToText).
    ids = torch.randint(0, 290, (2, 24), generator=torch.Generator().manual_seed(3))  # no image tokens
    ref_logits, _ = reference_outputs(src, ids, 1)
    with torch.no_grad():
        ours = load_chunks(HFCheckpoint(src), make_ps(world=1))[0](ids)[..., :300]
    assert_close(ours, ref_logits, rtol=0, atol=logit_bound(src, ids, ref_logits))


def test_trains_5_steps_and_exports_what_its_class_loads(tmp_path):
    from transformers import Gemma3ForConditionalGeneration

    from test_families import train_5_steps

    model = save_tiny_wrapped("gemma3", tmp_path / "m", vocab_size=512)
    processor = '{"image_seq_length": 4, "processor_class": "Gemma3Processor"}\n'  # side files a processor reads
    (model / "processor_config.json").write_text(processor)
    hf = train_5_steps(model, tmp_path / "out", tp=2)
    assert (hf / "processor_config.json").read_text() == processor
    before, after = folder_tensors(model), folder_tensors(hf)
    assert sorted(after) == sorted(before)
    others = [k for k in before if not k.startswith(TEXT)]
    assert others and [k for k in others if not _same_bytes(before[k], after[k])] == []
    trained = MPCheckpoint(tmp_path / "out" / "checkpoints")
    naming = ("language_model.model.", "language_model.lm_head.")
    text = {stored_name(n, naming): n for n in trained.hf_names()}
    assert sorted(text) == sorted(set(before) - set(others))
    assert all(torch.equal(after[k], trained.get(n)) for k, n in text.items())
    assert not torch.equal(before[TEXT + "model.layers.0.mlp.up_proj.weight"],
                           after[TEXT + "model.layers.0.mlp.up_proj.weight"])
    loaded = Gemma3ForConditionalGeneration.from_pretrained(hf).state_dict()
    assert torch.equal(loaded["model.language_model.layers.0.mlp.up_proj.weight"],
                       after[TEXT + "model.layers.0.mlp.up_proj.weight"])
    assert all(torch.equal(loaded["model." + k], before[k]) for k in others)  # in memory under `model.`


def test_lora_and_random_init_on_a_wrapped_checkpoint_are_refused_in_one_line(tmp_path):
    from hfmeg.train.parts.base import _random_weights

    src = save_tiny_wrapped("gemma3", tmp_path / "src")
    with pytest.raises(UnsupportedConfigError, match=r"^model.init: random on a multimodal checkpoint \(config.json "
                                                     r"model_type 'gemma3'\) is not supported; start from its weights$"):
        _random_weights(src, seed=0)
    with pytest.raises(UnsupportedConfigError, match=r"^peft.method: lora on a multimodal checkpoint \(config.json "
                                                     r"model_type 'gemma3'\) is not supported; fine-tune it in full$"):
        check_unwrapped(load_hf_config(src), PeftConfig(method="lora"))
