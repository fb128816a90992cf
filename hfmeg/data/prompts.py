"""Prompts for online RL: records with a `prompt` column, tokenised, with their other columns kept for rewards.

A record's `prompt` is a string (tokenised as it is, with the tokenizer's special tokens, as TRL does
for a standard prompt) or a conversation (a list of `{"role", "content"}` messages, rendered with the
tokenizer's chat template and the generation prompt, as TRL does for a conversational prompt). Its
other columns (`solution`, `answer`, test cases) travel beside the prompt to the reward functions as
keyword arguments, TRL's convention. The reader is resumable: `PromptReader.cursor` is the number of
records taken, and a reader made at that cursor goes on from the next one (a resume regenerates what
an uninterrupted run would have, with the sampling seeded per prompt: generation/).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import DataError
from .config import SourceConfig
from .sources import Source


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

    def __init__(self, source: SourceConfig, tokenizer, max_prompt_tokens: int, cursor: tuple[int, int] = (0, 0)):
        self.source, self.tok, self.limit = Source(source), tokenizer, max_prompt_tokens
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
        index = self.record
        self.record += 1
        return Prompt(ids, prompt, index, {k: v for k, v in raw.record.items() if k != self.column}, self.epoch)
