"""Preference records -> pairs of documents (a chosen and a rejected sequence), with TRL's token ids.

Layouts (`DataConfig.format`, field names mapped as for the SFT formats):
- `preference`, strings: `prompt`, `chosen`, `rejected`; conversational: `prompt` a message list, `chosen` and
  `rejected` message lists (`role`/`content`); without a `prompt` field (TRL's implicit prompt) the prompt is
  the answers' common prefix, cut as `trl.extract_prompt` cuts it;
- `sharegpt_preference`: LLaMA-Factory's layout: `conversations` (the prompt, `from`/`value` messages, ShareGPT
  roles), `chosen` and `rejected` each one message (or a list).

The token ids are the ones TRL's `DPOTrainer._prepare_dataset` (trl 1.16) makes, so a pair trains on the same
tokens in both: string answers get the EOS token's text appended (unless they end with it) and each text is
tokenised as the tokenizer's `__call__` does (its special tokens, e.g. BOS, added); conversational ones render
the prompt with the generation prompt and prompt + answer without it, through the chat template (the
tokenizer's, else `DEFAULT_CHAT_TEMPLATE`), and tokenise them with no special tokens added. The answer starts
where the tokenised prompt and the tokenised prompt + chosen / + rejected first differ (TRL's
`common_prefix_length`), which is not always the prompt's end (tokens that merge across the boundary).

Truncation is TRL's `keep_start` with `max_length = data.seq_len`: each sequence (prompt + answer) keeps its
first `seq_len` tokens (counted as `truncated_answer`), and a pair whose prompt alone has `seq_len` tokens or
more is dropped (`prompt_too_long`), as TRL drops it. Skipped and counted too: an empty or missing answer
(`empty_response`, `missing_field`), and answers that tokenise the same (`identical_answers`: no preference).
A long record costs about what a `seq_len` one does: texts are tokenised by prefixes (`Formatter._encode`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .formats import BadRecord, Doc, Formatter, Rendered

Problem = tuple[str, str]


@dataclass
class PairTexts:
    """One record's three texts: the prompt, prompt + chosen, prompt + rejected."""

    texts: tuple[str, str, str]
    special: bool  # string records: tokenised with the tokenizer's special tokens, as its `__call__` does


def extract_prompt(chosen: list | str, rejected: list | str) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) from two whole answers sharing a prompt, cut where `trl.extract_prompt` cuts:
    at the first message (or character) where they differ, a space before it going with the answers. When one
    is a prefix of the other, TRL's loop ends on the shorter one's last element, which then opens the answers."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


class PairFormatter(Formatter):
    """`Formatter` for preference records: `render` gives a record's `PairTexts`, `pairs` their documents."""

    def render(self, rec: dict[str, Any], fmt: str, fields: dict[str, str], limit: int | None = None) -> PairTexts:
        f, sharegpt = fields, fmt == "sharegpt_preference"
        answers = [rec.get(f[k]) for k in ("chosen", "rejected")]
        for k, a in zip(("chosen", "rejected"), answers):
            if a is None:
                raise BadRecord("missing_field", f"missing field {f[k]!r}")
        if sharegpt:
            answers = [[a] if isinstance(a, dict) else a for a in answers]
        strings = [isinstance(a, str) for a in answers]
        if all(strings):
            return self._strings(rec, f, *answers)
        if any(strings):
            raise BadRecord("invalid_record", f"fields {f['chosen']!r} and {f['rejected']!r}: one is a string, "
                                              "the other messages")
        chosen, rejected = (self._messages(a, f[k], f, sharegpt) for k, a in zip(("chosen", "rejected"), answers))
        if f["prompt"] in rec:
            prompt = self._messages(rec[f["prompt"]], f["prompt"], f, sharegpt)
        else:
            prompt, chosen, rejected = extract_prompt(chosen, rejected)
            for k, a in zip(("chosen", "rejected"), (chosen, rejected)):
                if not a:
                    raise BadRecord("empty_response", f"field {f[k]!r}: no answer after the prompt both share")
        if self.cfg.system_prompt and (not prompt or prompt[0]["role"] != "system"):
            prompt = [{"role": "system", "content": self.cfg.system_prompt}] + prompt
        texts = (self._apply(prompt, generation=True), self._apply(prompt + chosen), self._apply(prompt + rejected))
        return PairTexts(texts, special=False)

    def _strings(self, rec: dict[str, Any], f: dict[str, str], chosen: str, rejected: str) -> PairTexts:
        prompt = rec.get(f["prompt"])
        if f["prompt"] not in rec:
            prompt, chosen, rejected = extract_prompt(chosen, rejected)
        elif not isinstance(prompt, str):
            raise BadRecord("invalid_record", f"field {f['prompt']!r} is {type(prompt).__name__} but the answers "
                                              "are strings")
        for k, a in zip(("chosen", "rejected"), (chosen, rejected)):
            if not a.strip():
                raise BadRecord("empty_response", f"empty field {f[k]!r}")
        eos = self.tok.eos_token or ""
        ends = [a if a.endswith(eos) else a + eos for a in (chosen, rejected)]
        return PairTexts((prompt, prompt + ends[0], prompt + ends[1]), special=True)

    def pairs(self, batch: list[PairTexts], limit: int) -> list[tuple[list[Doc], Problem | None]]:
        """Each record's (chosen, rejected) documents, truncated to `limit` tokens, or none and its problem.

        A document's targets are its answer tokens; its `ids` are prompt + answer."""
        out = []
        for special in (False, True):
            mine = [i for i, p in enumerate(batch) if p.special == special]
            rendered = [Rendered(t, []) for i in mine for t in batch[i].texts]
            encs = self._encode(rendered, limit, special) if rendered else []
            for n, i in enumerate(mine):
                out.append((i, self._pair([e.ids[:limit + 1] if cut else e.ids
                                           for e, cut in encs[3 * n:3 * n + 3]], limit)))
        return [o for _, o in sorted(out, key=lambda o: o[0])]

    @staticmethod
    def _pair(ids: list[list[int]], limit: int) -> tuple[list[Doc], Problem | None]:
        prompt, chosen, rejected = ids
        start = min(common_prefix(prompt, chosen), common_prefix(prompt, rejected))
        if start >= limit:
            return [], ("prompt_too_long", f"the prompt alone has >= seq_len {limit} tokens; dropped")
        if chosen[start:] == rejected[start:]:
            return [], ("identical_answers", "chosen and rejected answers are the same tokens")
        docs = []
        for seq in (chosen, rejected):
            target = (np.arange(len(seq)) >= start)[:limit]
            if not target[1:].any():  # no answer token is predicted from a token before it
                return [], ("empty_response", "an answer has no token to train on")
            docs.append(Doc(np.asarray(seq[:limit], dtype=np.int64), target))
        if max(len(chosen), len(rejected)) > limit:
            return docs, ("truncated_answer", f"prompt + answer longer than seq_len {limit}; cut to fit")
        return docs, None
