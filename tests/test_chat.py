"""`hfmeg chat` (hfmeg/commands/chat.py): a run's export, its MP checkpoint and standard input give the replies
transformers' greedy `generate` gives on the export, with the chat template and system prompt the run trained
with (the export's tokenizer records the template; the run's config.yaml holds the system prompt).

The run: stories260K (no chat template of its own, so hfmeg's default is the one trained with and recorded)
fine-tuned 2 steps on alpaca in fp32 in a world of one; its checkpoint converts to the export's weights bit for
bit, so every path must give the same tokens.
"""

from __future__ import annotations

import io
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hfmeg.commands.main import main as hfmeg
from hfmeg.data.formats import DEFAULT_CHAT_TEMPLATE
from hfmeg.parallel.launch import spawn
from test_train import _assets, _config, _run

PROMPTS = ["Tell me a story about a dog.", "What happened next?"]
SYSTEM = "You tell short stories."
NEW_TOKENS = 24


def _reference(folder, adapter=None, template=None) -> list[str]:
    """Each turn's reply by transformers alone (with `adapter`: peft's model on the base `folder`): the folder's
    own template (or `template`), greedy."""
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    tok = AutoTokenizer.from_pretrained(str(folder))
    chat, replies = [{"role": "system", "content": SYSTEM}], []
    for prompt in PROMPTS:
        chat.append({"role": "user", "content": prompt})
        enc = tok.apply_chat_template(chat, chat_template=template, add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)
        out = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.eos_token_id)
        replies.append(tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip())
        chat.append({"role": "assistant", "content": replies[-1]})
    return replies


def _chat(capfd, *argv: str) -> str:
    assert hfmeg(["chat", *argv, "--max-new-tokens", str(NEW_TOKENS)]) == 0
    return capfd.readouterr().out


def test_chat_replies_equal_transformers_greedy_on_the_export(tmp_path, capfd, monkeypatch):
    model = _assets()
    out = tmp_path / "run"
    cfg = _config(out, model, steps=2, gbs=2)
    cfg.data.system_prompt = SYSTEM
    spawn(_run, 1, cfg)
    capfd.readouterr()
    replies = _reference(out / "hf")
    assert len(replies) == 2 and all(replies), replies  # a reply per turn, none empty
    expected = "".join(reply + "\n" for reply in replies)  # printed one after the other
    flags = [a for p in PROMPTS for a in ("--prompt", p)]
    assert _chat(capfd, str(out), *flags) == expected  # the run's --out: its export
    assert _chat(capfd, str(out / "checkpoints" / "iter_0000002"), *flags) == expected  # converted for the chat
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(p + "\n" for p in PROMPTS)))
    assert _chat(capfd, str(out / "hf")) == expected  # each line a turn; the system prompt from OUT/config.yaml


def test_chat_on_a_lora_runs_adapter_and_checkpoint(tmp_path, capfd):
    """A LoRA run: its PEFT adapter folder (no tokenizer in it: the base's) replies as peft's model on the base
    does; its checkpoint (merged for the chat) as transformers on the run's merged export does."""
    model = _assets()
    out = tmp_path / "lora"
    cfg = _config(out, model, steps=2, gbs=2, lr=2e-2)
    cfg.data.system_prompt = SYSTEM
    cfg.peft.method = "lora"
    spawn(_run, 1, cfg)
    capfd.readouterr()
    flags = [a for p in PROMPTS for a in ("--prompt", p)]
    # the base has no chat template: the run trained with hfmeg's default, which an adapter folder does not carry
    unmerged = "".join(r + "\n" for r in _reference(model, adapter=out / "adapter", template=DEFAULT_CHAT_TEMPLATE))
    assert _chat(capfd, str(out / "adapter"), "--system", SYSTEM, *flags) == unmerged
    merged = "".join(r + "\n" for r in _reference(out / "hf"))
    assert _chat(capfd, str(out / "checkpoints"), *flags) == merged


def test_chat_on_a_folder_that_is_no_model_is_one_line_exit_2(tmp_path, capfd):
    assert hfmeg(["chat", str(tmp_path), "--prompt", "hi"]) == 2
    err = capfd.readouterr().err.strip()
    assert err == (f"error: {tmp_path}: not a model hfmeg chat can load (an HF folder with config.json, a PEFT "
                   "adapter folder, a run's --out, or an MP checkpoint)"), err
