"""Prompts for online RL: records with a `prompt` column, tokenised, with their other columns kept for rewards.

A record's `prompt` is a string (tokenised as it is, with the tokenizer's special tokens, as TRL does
for a standard prompt) or a conversation (a list of `{"role", "content"}` messages, rendered with the
tokenizer's chat template and the generation prompt, as TRL does for a conversational prompt). Its
other columns (`solution`, `answer`, test cases) travel beside the prompt to the reward functions as
keyword arguments, TRL's convention. The reader is resumable: `PromptReader.cursor` is the number of
records taken, and a reader made at that cursor goes on from the next one (a resume regenerates what
an uninterrupted run would have, with the sampling seeded per prompt: generation/). With `data.eval_split`
the source's held-out records are never read for training and are the evaluation's prompts
(`eval_prompts`, in the split's order); `data.eval_sources` are read whole instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import DataError
from .config import DataConfig, SourceConfig
from .sources import Raw, Source


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids, its text as the reward functions see it, its epoch and record index, other columns."""

    ids: list[int]
    text: Any  # the record's prompt as given (a string or a message list)
    index: int
    columns: dict[str, Any] = field(default_factory=dict)
    epoch: int = 0


def prompt_ids(tokenizer, prompt: Any, where: str) -> list[int]:
    """The token ids of a prompt (module doc); DataError naming `where` for anything else."""
    if isinstance(prompt, str):
        ids = tokenizer(prompt).input_ids
    elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"]
    else:
        raise DataError(f"{where}: prompt must be a string or a list of {{role, content}} messages, got "
                        f"{type(prompt).__name__}")
    if not ids:
        raise DataError(f"{where}: the prompt has no tokens")
    return list(ids)


class PromptReader:
    """The prompts of one source, in order, cycling over epochs, from `(epoch, record)` = `cursor` on."""

    def __init__(self, source: SourceConfig, tokenizer, max_prompt_tokens: int, cursor: tuple[int, int] = (0, 0), *,
                 seed: int = 0, eval_split: int | float = 0):
        self.source = Source(source, seed=seed, eval_split=eval_split)
        self.tok, self.limit = tokenizer, max_prompt_tokens
        self.epoch, self.record = cursor
        self.column = source.fields.get("prompt", "prompt")
        self._records: Iterator | None = None

    @property
    def cursor(self) -> tuple[int, int]:
        """(epoch, record index in it) of the next prompt: what a resume hands back to the constructor."""
        return self.epoch, self.record

    def take(self, n: int) -> list[Prompt]:
        """The next `n` prompts; the cursor moves past them."""
        return [self._next() for _ in range(n)]

    def _next(self) -> Prompt:
        if self._records is None:
            self._records = self.source.records(self.epoch, self.record)
        raw = next(self._records, None)
        if raw is None:  # the epoch is done: the next starts at record 0
            if self.record == 0:
                raise DataError(f"data source {self.source.name}: no records")
            self.epoch, self.record = self.epoch + 1, 0
            self._records = self.source.records(self.epoch)
            raw = next(self._records)
        index = self.record
        self.record += 1
        return self.prompt(raw, index, self.epoch)

    def prompt(self, raw: Raw, index: int, epoch: int = 0) -> Prompt:
        """The `Prompt` of a record of this reader's source (DataError naming the record for a bad one)."""
        if raw.record is None:
            raise DataError(f"{raw.where}: {raw.problem}")
        if self.column not in raw.record:
            raise DataError(f"{raw.where}: no {self.column!r} column (a prompt dataset needs one; columns: "
                            f"{', '.join(sorted(raw.record))})")
        prompt = raw.record[self.column]
        ids = prompt_ids(self.tok, prompt, raw.where)
        if len(ids) > self.limit:
            raise DataError(f"{raw.where}: the prompt has {len(ids)} tokens, more than the {self.limit} the sequence "
                            "leaves beside grpo.max_completion_length")
        return Prompt(ids, prompt, index, {k: v for k, v in raw.record.items() if k != self.column}, epoch)

    def held_out(self) -> list[Prompt]:
        """The source's held-out records (`data.eval_split`) as prompts, in the split's order."""
        return [self.prompt(raw, i) for i, raw in enumerate(self.source.held_out())]


def eval_prompts(cfg: DataConfig, tokenizer, max_prompt_tokens: int) -> list[Prompt]:
    """An evaluation's prompts: the training source's held-out records, or every record of `data.eval_sources`."""
    if not cfg.eval_sources:
        return PromptReader(cfg.sources[0], tokenizer, max_prompt_tokens, seed=cfg.seed,
                            eval_split=cfg.eval_split).held_out()
    out = []
    for source in cfg.eval_sources:
        reader = PromptReader(source, tokenizer, max_prompt_tokens)
        out += [reader.prompt(raw, i) for i, raw in enumerate(reader.source.records())]
    return out
