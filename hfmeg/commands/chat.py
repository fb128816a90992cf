"""Chat with a trained model, for a quick look after training.

    hfmeg chat OUT                                       # a run's --out: its export OUT/hf, else its latest checkpoint
    hfmeg chat OUT/hf --prompt "Hi" --prompt "And then?" # one conversation, the replies printed, no prompt read
    echo "Tell me a story" | hfmeg chat OUT/checkpoints  # each line of standard input is one user turn

MODEL is an HF folder (an export), a PEFT adapter folder (its base, and the base's tokenizer where the folder
has none, from `adapter_config.json`; needs `peft`),
a run's `--out`, or an MP checkpoint (a run's `checkpoints/`, one `iter_*` of it, or `convert to-mp`
output; `--iteration N` picks one), which is converted into a temporary HF folder first (a LoRA checkpoint:
merged onto its base). The conversation is rendered as training rendered it (`data/formats.py`): the
tokenizer's own chat template, else hfmeg's default, with the run's `data.system_prompt` (read from
`OUT/config.yaml` beside the model, or `--system`), tokenized without added special tokens, then
`transformers`' `generate` continues it (greedy unless `--temperature` > 0) to the model's end-of-turn
token. Without `--prompt` and with a terminal, it asks for each turn (an empty line or Ctrl-D ends).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import yaml

from ..checkpoint.cli import run_cli
from ..checkpoint.mp_layout import HF_DIR, is_mp_folder, resolve_iteration_dir
from ..data.formats import chat_template
from ..errors import CheckpointError, HfmegError
from ..flags import Parser
from ..train.trainer import CONFIG_FILE as RUN_CONFIG
from .export import CHECKPOINTS

ADAPTER_CONFIG = "adapter_config.json"


def _system_prompt(path: Path) -> str | None:
    """The `data.system_prompt` of the run MODEL belongs to: OUT, OUT/hf, OUT/checkpoints or one checkpoint in it."""
    path = path.resolve()
    for run in (path, path.parent, path.parent.parent):
        if (run / RUN_CONFIG).is_file():
            data = yaml.safe_load((run / RUN_CONFIG).read_text()) or {}
            return (data.get("data") or {}).get("system_prompt") or None
    return None


def load(path: Path, iteration: int | None, scratch: Path):
    """(model, tokenizer) for MODEL `path` (module doc), converting an MP checkpoint into `scratch`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..checkpoint.convert import mp_to_hf
    from ..peft.export import export_checkpoint, is_adapter_checkpoint

    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if iteration is None and (path / HF_DIR / "config.json").is_file() and (path / RUN_CONFIG).is_file():
        path = path / HF_DIR  # a run's --out with its export
    elif (path / CHECKPOINTS).is_dir():
        path = path / CHECKPOINTS
    if (path / ADAPTER_CONFIG).is_file():
        return _peft_model(path)
    if (path / "config.json").is_file() and not is_mp_folder(path):
        return (AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval(),
                AutoTokenizer.from_pretrained(str(path)))
    if not is_mp_folder(path):
        raise CheckpointError(f"{path}: not a model hfmeg chat can load (an HF folder with config.json, a PEFT "
                              f"adapter folder, a run's --out, or an MP checkpoint)")
    iter_dir = resolve_iteration_dir(path, iteration)
    if is_adapter_checkpoint(iter_dir):
        folder = scratch / "merged"
        export_checkpoint(iter_dir, scratch / "adapter", merged=folder)
    else:
        folder = mp_to_hf(iter_dir, scratch / "hf")
    print(f"converted {iter_dir} for this chat", file=sys.stderr, flush=True)
    return (AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(str(folder)))


def _peft_model(folder: Path):
    try:
        from peft import AutoPeftModelForCausalLM
    except ImportError:
        raise HfmegError(f"{folder}: a PEFT adapter; loading it needs peft (pip install peft)") from None
    import torch
    from transformers import AutoTokenizer

    model = AutoPeftModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    # an adapter folder may carry no tokenizer: then the base's, which its run trained with
    tokenizer_from = folder if (folder / "tokenizer_config.json").is_file() else \
        model.peft_config[model.active_adapter].base_model_name_or_path
    return model, AutoTokenizer.from_pretrained(str(tokenizer_from))


def reply(model, tokenizer, template: str, chat: list[dict[str, str]], max_new_tokens: int,
          temperature: float) -> str:
    """The model's next assistant message after `chat`, as training rendered a conversation."""
    import torch

    text = tokenizer.apply_chat_template(chat, chat_template=template, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])
    sampling = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             pad_token_id=pad, **sampling)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def _turns(prompts: list[str] | None):
    """The user's turns: --prompt's, else standard input's lines, else asked one by one at a terminal."""
    if prompts:
        yield from prompts
    elif not sys.stdin.isatty():
        yield from (line.rstrip("\n") for line in sys.stdin if line.strip())
    else:
        while True:
            try:
                line = input("you> ")
            except EOFError:
                return
            if not line.strip():
                return
            yield line


def chat(args: argparse.Namespace) -> int:
    path = Path(args.model)
    with tempfile.TemporaryDirectory(prefix="hfmeg-chat-") as scratch:
        model, tokenizer = load(path, args.iteration, Path(scratch))
        template = chat_template(tokenizer)
        system = args.system if args.system is not None else _system_prompt(path)
        history = [{"role": "system", "content": system}] if system else []
        for turn in _turns(args.prompt):
            history.append({"role": "user", "content": turn})
            answer = reply(model, tokenizer, template, history, args.max_new_tokens, args.temperature)
            history.append({"role": "assistant", "content": answer})
            print(answer if args.prompt or not sys.stdin.isatty() else f"model> {answer}", flush=True)
    return 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", metavar="MODEL", help="an HF export, a PEFT adapter folder, a run's --out, or an MP "
                    "checkpoint")
    ap.add_argument("--prompt", action="append", help="a user turn (repeatable: one conversation); the replies are "
                    "printed one per turn")
    ap.add_argument("--system", default=None, help="the system message (default: the run's data.system_prompt)")
    ap.add_argument("--iteration", type=int, default=None, help="an MP checkpoint's step (default: the latest)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens a reply may have (default: 128)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy (default)")
    args = ap.parse_args(argv)
    return run_cli(lambda: chat(args))
