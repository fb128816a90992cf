"""Tokenizers hfmeg writes load with the lowest transformers `pyproject.toml` allows (issue 33).

transformers 5 saves fast tokenizers as `TokenizersBackend`, which 4.x cannot load; `save_tokenizer` /
`make_portable` (checkpoint/tokenizer_files.py) write what both read. The lowest version runs in
`.venv-lowest` (`make test` creates it: that transformers and the CPU torch), in a subprocess, and must give the
ids and the chat rendering the installed version gives, and an export's `generate(**tok(text))` the same tokens.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from packaging.version import Version
from tool_loader import load_tool
from transformers import AutoTokenizer

from hfmeg.checkpoint.tokenizer_files import PORTABLE_CLASS, make_portable

ROOT = Path(__file__).resolve().parents[1]
LOWEST = ROOT / ".venv-lowest" / "bin" / "python"
TEXTS = ["Which city is the capital of France?", "Fern has 7 apples  and gives away 2.\n\nHow many?", "héllo wörld"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
# what one transformers version makes of a tokenizer folder: ids, decoded text, chat rendering
PROBE = """
import json, sys, warnings
warnings.simplefilter("ignore")
import transformers
from transformers import AutoTokenizer
texts, chat = json.loads(sys.argv[2]), json.loads(sys.argv[3])
tok = AutoTokenizer.from_pretrained(sys.argv[1])
ids = [tok(t).input_ids for t in texts]
print(json.dumps({"version": transformers.__version__, "ids": ids, "inputs": sorted(tok(texts[0])), "decoded": [tok.decode(i) for i in ids],
                  "chat": tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                  if tok.chat_template else None}))
"""


# what one transformers version generates from an export folder, as its model card shows: generate(**tok(...))
GENERATE = """
import json, sys, warnings
warnings.simplefilter("ignore")
import torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32)
out = model.generate(**tok(sys.argv[2], return_tensors="pt"), max_new_tokens=16, do_sample=False,
                     pad_token_id=tok.eos_token_id)
print(json.dumps({"version": transformers.__version__, "ids": out[0].tolist()}))
"""


def _lowest_version() -> str:
    return re.search(r'"transformers>=([0-9.]+)', (ROOT / "pyproject.toml").read_text())[1]


def _probe(python: str, folder: Path) -> dict:
    proc = subprocess.run([python, "-c", PROBE, str(folder), json.dumps(TEXTS), json.dumps(CHAT)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def lowest() -> str:
    if not LOWEST.is_file():
        pytest.skip(f"{LOWEST.parent.parent.name} is absent (`make test` creates it with transformers=="
                    f"{_lowest_version()})")
    return str(LOWEST)


def _same_in_both(lowest: str, folder: Path) -> dict:
    import sys

    theirs, ours = _probe(lowest, folder), _probe(sys.executable, folder)
    assert Version(theirs["version"]) == Version(_lowest_version()), "`.venv-lowest` is stale: rerun `make test`"
    assert theirs["ids"] == ours["ids"] and theirs["decoded"] == ours["decoded"] and theirs["chat"] == ours["chat"]
    # what a decoder-only model's generate() takes, no token_type_ids (4.x's default for a fast tokenizer)
    assert theirs["inputs"] == ours["inputs"] == ["attention_mask", "input_ids"]
    return ours


def test_the_demo_tokenizer_loads_with_the_lowest_transformers(lowest, tmp_path):
    demo = load_tool("demo")
    demo.build_tokenizer(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == PORTABLE_CLASS
    ours = _same_in_both(lowest, tmp_path)
    assert "### Instruction:\nHi there" in ours["chat"]  # the demo trains with hfmeg's default template


def test_a_tokenizer_saved_by_transformers_5_is_made_portable(lowest, tmp_path):
    from helpers import stories_or_skip

    tok = AutoTokenizer.from_pretrained(stories_or_skip())
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if written.get("tokenizer_class") != "TokenizersBackend":
        pytest.skip("this transformers saves a class name 4.x knows: nothing to make portable")
    make_portable(tmp_path)  # as the export does with the base's copied tokenizer files
    ours = _same_in_both(lowest, tmp_path)
    assert ours["chat"].startswith("<system>Be brief.<user>Hi there")


def test_an_export_generates_with_the_lowest_transformers(lowest, tmp_path):
    """The model card's `model.generate(**tok(text, return_tensors="pt"))` on an export folder (stories260K's
    weights and config, its tokenizer made portable as the export makes the base's): the same greedy tokens
    with the lowest transformers as with the installed one (no token_type_ids for generate to refuse)."""
    import shutil
    import sys

    from helpers import stories_or_skip

    shutil.copytree(stories_or_skip(), tmp_path / "hf")
    make_portable(tmp_path / "hf")
    runs = []
    for python in (lowest, sys.executable):
        proc = subprocess.run([python, "-c", GENERATE, str(tmp_path / "hf"), "Once upon a time"],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.splitlines()[-1]))
    theirs, ours = runs
    assert Version(theirs["version"]) == Version(_lowest_version()), "`.venv-lowest` is stale: rerun `make test`"
    assert theirs["ids"] == ours["ids"] and len(ours["ids"]) > 16, (theirs, ours)  # the prompt and 16 new tokens
