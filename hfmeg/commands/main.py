"""`hfmeg COMMAND ...` (the console script, and `python -m hfmeg`): one command per job, each with its own
`--help`. A command's module is imported only when it runs, so `hfmeg --help` and `hfmeg plan` stay quick."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NamedTuple

from .. import __version__
from ..flags import Parser


class Command(NamedTuple):
    target: str  # "module:function", called as function(argv, prog=...) and returning the exit code
    summary: str


COMMANDS = {
    "train": Command("hfmeg.train.cli:train_command",
                     "train a model: a YAML config or a built-in recipe (--recipe), plus flags; under torchrun or "
                     "accelerate launch as -m hfmeg train"),
    "convert": Command("hfmeg.commands.convert:main",
                       "convert a checkpoint: to-mp (HF folder or Hub id -> TP x PP shards, a PEFT adapter too) or "
                       "to-hf (shards -> HF folder; a LoRA checkpoint -> PEFT adapter folder, --merge)"),
    "reshard": Command("hfmeg.commands.reshard:main",
                       "reshard an MP checkpoint to another TP x PP (x VPP); a training checkpoint whole"),
    "verify": Command("hfmeg.commands.verify:main",
                      "check an MP checkpoint against transformers: logits and greedy generation"),
    "export": Command("hfmeg.commands.export:main",
                      "export a run's checkpoint (finished or interrupted) to OUT/hf (+ OUT/adapter) with its "
                      "model card, as the end of training does; push with --push-to-hub"),
    "chat": Command("hfmeg.commands.chat:main",
                    "chat with a trained model (an export, a run's --out, an MP checkpoint or an adapter) in the "
                    "chat template it trained with; --prompt for one conversation without a terminal"),
    "launch": Command("hfmeg.commands.launch:main",
                      "run torchrun or accelerate launch (their flags as they are) with a stopped job's exit code: "
                      "Ctrl-C exits 130 (SIGTERM 143) with one line, after the workers saved"),
    "plan": Command("hfmeg.plan.cli:main",
                    "the layout planner: rank layouts by predicted step time; calibrate, scaling, published"),
}


def _parser() -> argparse.ArgumentParser:
    ap = Parser(prog="hfmeg", description="Megatron-style TP/PP/DP fine-tuning of Hugging Face "
                                 "models. `hfmeg COMMAND --help` describes each command.")
    ap.add_argument("--version", action="version", version=f"hfmeg {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", title="commands", required=True)
    for name, cmd in COMMANDS.items():
        sub.add_parser(name, help=cmd.summary, add_help=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        _parser().parse_args(argv)  # --help, --version, or the usage and exit 2 for no or an unknown command
        return 2
    module, function = COMMANDS[argv[0]].target.split(":")
    return getattr(importlib.import_module(module), function)(argv[1:], prog=f"hfmeg {argv[0]}")
