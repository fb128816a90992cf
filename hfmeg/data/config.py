"""`DataConfig`: the one typed description of a run's training and eval data.

A source's `path` is local when it names an existing file or folder or is a glob
(`*`, `?`, `[`); a path ending in a data extension that does not exist is an
error, not a Hub lookup. Anything else is a Hugging Face Hub dataset id, read with
`datasets.load_dataset(path, config, split=, revision=, streaming=True)`.

`fields` maps the canonical field names of a format to the record's own keys:
- alpaca: instruction, input, output, system (input and system optional);
- messages: messages, role, content;
- sharegpt: conversations, from, value;
- text: text;
- preference: prompt, chosen, rejected, role, content (strings, or `role`/`content` message lists: TRL's
  preference layouts; without a `prompt` field the prompt is the answers' common prefix);
- sharegpt_preference: conversations (the prompt), chosen, rejected, from, value (a chosen/rejected answer is one
  message or a list; LLaMA-Factory's layout). Preference records become pairs (data/preference.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import DataError

Format = Literal["alpaca", "messages", "sharegpt", "text", "preference", "sharegpt_preference"]
PREFERENCE_FORMATS = ("preference", "sharegpt_preference")

DEFAULT_FIELDS: dict[str, dict[str, str]] = {
    "alpaca": {"instruction": "instruction", "input": "input", "output": "output", "system": "system"},
    "messages": {"messages": "messages", "role": "role", "content": "content"},
    "sharegpt": {"messages": "conversations", "role": "from", "content": "value"},
    "text": {"text": "text"},
    "preference": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected", "role": "role",
                   "content": "content"},
    "sharegpt_preference": {"prompt": "conversations", "chosen": "chosen", "rejected": "rejected", "role": "from",
                            "content": "value"},
}


@dataclass
class SourceConfig:
    path: str  # Hub dataset id, or a local file / folder / glob (json, jsonl, parquet, txt)
    config: str | None = None  # Hub dataset config name
    split: str = "train"
    revision: str | None = None  # Hub branch, tag or commit
    weight: float = 1.0  # relative sampling weight when several sources are mixed
    format: Format | None = None  # overrides DataConfig.format for this source
    fields: dict[str, str] = field(default_factory=dict)  # canonical name -> record key


@dataclass
class DataConfig:
    sources: list[SourceConfig] = field(default_factory=list)
    format: Format = "alpaca"
    system_prompt: str | None = None  # default system message for alpaca/messages records without one
    train_on_prompt: bool = False  # False: loss on response tokens only
    seq_len: int = 2048
    packing: bool = True  # False: one example per row, padded to seq_len
    # split: pieces of seq_len (text); preference data: truncate only (TRL's keep_start, data/preference.py)
    overlong: Literal["truncate", "drop", "split"] = "truncate"
    bad_data: Literal["report", "fail"] = "report"
    seed: int = 0  # seeds the eval split, each epoch's shuffle and the weighted mixing of sources
    shuffle: bool = True  # each source's training records in a new seeded order every epoch (False: file order)
    shuffle_buffer: int = 1000  # records in `datasets`' shuffle buffer, for streamed Hub datasets
    eval_sources: list[SourceConfig] = field(default_factory=list)
    # held out of each training source for eval, never trained on: a count of records, or a fraction in (0, 1)
    eval_split: int | float = 0
    read_ahead: int = 64  # records rendered and tokenized per batch call
    prefetch: int = 2  # global batches built ahead in a thread; in training on the device, masks built (0: when asked for)

    def __post_init__(self) -> None:
        if self.seq_len < 2:
            raise DataError(f"data.seq_len must be >= 2, got {self.seq_len}")
        if self.read_ahead < 1:
            raise DataError(f"data.read_ahead must be >= 1, got {self.read_ahead}")
        if self.prefetch < 0:
            raise DataError(f"data.prefetch must be >= 0, got {self.prefetch}")
        if not (0 < self.eval_split < 1 if isinstance(self.eval_split, float) else self.eval_split >= 0):
            raise DataError(f"data.eval_split must be a count >= 0 or a fraction in (0, 1), got {self.eval_split}")
        if self.eval_split and self.eval_sources:
            raise DataError("data.eval_split and data.eval_sources both name eval data: set one of them")
        if self.shuffle_buffer < 1:
            raise DataError(f"data.shuffle_buffer must be >= 1, got {self.shuffle_buffer}")
        kinds = {f in PREFERENCE_FORMATS for f in self._formats()}
        if len(kinds) > 1:
            raise DataError("data sources mix preference pairs and SFT/text records: a run trains on one kind")
        if self.preference and self.overlong != "truncate":
            raise DataError(f"data.overlong: {self.overlong!r} does not apply to preference pairs, which are "
                            "truncated as TRL truncates them (keep the default 'truncate')")
        if self.preference and self.train_on_prompt:
            raise DataError("data.train_on_prompt does not apply to preference pairs: their loss is on the answers")
        for i, s in enumerate(self.sources + self.eval_sources):
            if not s.weight > 0:
                raise DataError(f"data source {s.path!r}: weight must be > 0, got {s.weight}")
            fmt = s.format or self.format
            unknown = set(s.fields) - set(DEFAULT_FIELDS[fmt])
            if unknown:
                raise DataError(f"data source {s.path!r}: unknown field {sorted(unknown)[0]!r} for format "
                                f"{fmt} (known: {', '.join(DEFAULT_FIELDS[fmt])})")

    @property
    def preference(self) -> bool:
        """The sources hold preference pairs (the config refuses a mix with other records)."""
        return self._formats()[0] in PREFERENCE_FORMATS

    def _formats(self) -> list[str]:
        return [s.format or self.format for s in self.sources + self.eval_sources] or [self.format]

    def fields_of(self, source: SourceConfig) -> tuple[str, dict[str, str]]:
        """The format of `source` and its canonical-name -> record-key mapping."""
        fmt = source.format or self.format
        return fmt, {**DEFAULT_FIELDS[fmt], **source.fields}
