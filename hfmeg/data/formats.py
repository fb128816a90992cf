"""Records -> token ids + per-token loss targets.

Every SFT format becomes a chat (`[{"role", "content"}]`) first:
- alpaca: optional system (the record's `system` field, else `DataConfig.system_prompt`),
  user = instruction, or instruction + "\\n\\n" + input when input is not empty,
  assistant = output;
- messages: the list as is; sharegpt: `from`/`value` with roles human->user,
  gpt/chatgpt/model->assistant, system->system.
`DataConfig.system_prompt` is prepended to chats that start without a system message.

The chat is rendered to text with `tokenizer.apply_chat_template` and the
tokenizer's own `chat_template`; a tokenizer without one gets `DEFAULT_CHAT_TEMPLATE`:

    <bos>{system}\\n\\n### Instruction:\\n{user}\\n\\n### Response:\\n{assistant}<eos>### Instruction:\\n...

Loss mask: the text of assistant turn i is the character span from the end of
`render(messages[:i], add_generation_prompt=True)` to the end of
`render(messages[:i+1])` — its content plus the template's end-of-turn marker, so
the model learns to stop. (Templates must render a conversation's prefixes as
string prefixes of the whole; nearly all do, and one that does not is reported.)
The whole text is tokenized once with offsets (a fast tokenizer is required) and
token t is a target when its last character lies in an assistant span.
`train_on_prompt` makes every token a target.

Plain text: `[bos] + tokens + [eos]` (when the tokenizer has them), all targets.

Overlong records are cut before rendering and tokenising (`render(limit=)` and
`tokenize(limit=)`, used by the truncate and drop policies, which need only the
first `limit + 1` tokens), so a 3 MB record costs about what a `seq_len` record
costs:
- `render` clips every message (or plain text) to `CLIP_BUDGETS` character budgets
  of `CHARS_PER_TOKEN * (limit + GUARD_TOKENS)`; the rendered text then equals the
  whole record's rendering in its first `Rendered.exact` characters (the shortest
  clipped content, stripped: templates insert a message verbatim or trimmed);
- `tokenize` tokenises a prefix of one budget, doubled while it yields fewer than
  `limit + GUARD_TOKENS` tokens and is shorter than the exact part; past that (a
  normalizer that deletes long runs, say) the record is rendered whole;
- the doc keeps its first `limit + 1` tokens and is marked `cut`.
The kept tokens equal the whole text's unless the tokenizer's choice for a token
depends on text more than `GUARD_TOKENS` tokens after it: a pre-tokenizer confines
a cut's effect to the word it falls in, and BPE merges without one (LLaMA-2's
Metaspace) only join neighbouring symbols; tests/test_data_overlong.py checks
equality on real text, code and a 30k-character word, cut at hundreds of places.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import DataError
from .config import DataConfig

DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}### Instruction:\n{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'assistant' %}### Response:\n{{ m['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}### Response:\n{% endif %}"
)

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "model": "assistant", "assistant": "assistant", "system": "system"}


class BadRecord(Exception):
    """A record that cannot be used; `kind` is one of the bad-data report's kinds."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class Rendered:
    text: str
    spans: list[tuple[int, int]]  # character spans of loss targets
    add_bos_eos: bool = False  # plain text: ids added around the tokens
    exact: int | None = None  # clipped: only the first `exact` characters are the record's; None: all
    whole: Callable[[], Rendered] | None = None  # clipped: renders the record unclipped


@dataclass
class Doc:
    ids: np.ndarray  # int64 [L]
    target: np.ndarray  # bool [L]: token t is a loss target (predicted from t-1)
    cut: bool = False  # the text was cut before tokenising: it has more tokens than `ids`


CHARS_PER_TOKEN = 8  # first guess of characters per token; real text averages 3-5
GUARD_TOKENS = 64  # tokens tokenised past the kept ones, so the cut cannot change them
CLIP_BUDGETS = 4  # a message is clipped to this many budgets: room for two doublings


def char_budget(limit: int) -> int:
    return CHARS_PER_TOKEN * (limit + GUARD_TOKENS)


def _text(rec: dict[str, Any], key: str, required: bool) -> str:
    v = rec.get(key)
    if v is None:
        if required:
            raise BadRecord("missing_field", f"missing field {key!r}")
        return ""
    if not isinstance(v, str):
        raise BadRecord("missing_field", f"field {key!r} is {type(v).__name__}, expected a string")
    return v


def chat_template(tokenizer) -> str:
    """The template a chat is rendered with: the tokenizer's own, else `DEFAULT_CHAT_TEMPLATE`."""
    return getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE


class Formatter:
    def __init__(self, cfg: DataConfig, tokenizer):
        self.cfg = cfg
        self.tok = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        if self.backend is None:
            raise DataError(f"{type(tokenizer).__name__}: a fast (tokenizers-backed) tokenizer is needed "
                            "for loss masks from character offsets")
        self.template = chat_template(tokenizer)
        self.bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        self.eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def render(self, rec: dict[str, Any], fmt: str, fields: dict[str, str], limit: int | None = None) -> Rendered:
        """The text of one record and its target spans; raises `BadRecord`. With `limit`, long
        contents are clipped (see the module docstring)."""
        clip = None if limit is None else CLIP_BUDGETS * char_budget(limit)
        if fmt == "text":
            text = _text(rec, fields["text"], True)
            if not text.strip():
                raise BadRecord("empty_response", f"empty field {fields['text']!r}")
            if clip is not None and len(text) > clip:
                return Rendered(text[:clip], [(0, clip)], True, clip, lambda: self.render(rec, fmt, fields))
            return Rendered(text, [(0, len(text))], add_bos_eos=True)
        if fmt == "alpaca":
            chat = self._alpaca(rec, fields)
        else:
            chat = self._chat(rec, fields, sharegpt=fmt == "sharegpt")
        if self.cfg.system_prompt and chat[0]["role"] != "system":
            chat.insert(0, {"role": "system", "content": self.cfg.system_prompt})
        long = [m for m in chat if clip is not None and len(m["content"]) > clip]
        if not long:
            return self._render_chat(chat)
        for m in long:
            m["content"] = m["content"][:clip]
        r = self._render_chat(chat)
        r.exact = min(len(m["content"].strip()) for m in long)
        r.whole = lambda: self.render(rec, fmt, fields)
        return r

    def _alpaca(self, rec: dict[str, Any], f: dict[str, str]) -> list[dict[str, str]]:
        instruction = _text(rec, f["instruction"], True)
        extra = _text(rec, f["input"], False)
        output = _text(rec, f["output"], True)
        system = _text(rec, f["system"], False)
        if not output.strip():
            raise BadRecord("empty_response", f"empty field {f['output']!r}")
        user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        chat = [{"role": "system", "content": system}] if system.strip() else []
        return chat + [{"role": "user", "content": user}, {"role": "assistant", "content": output}]

    def _chat(self, rec: dict[str, Any], f: dict[str, str], sharegpt: bool) -> list[dict[str, str]]:
        chat = self._messages(rec.get(f["messages"]), f["messages"], f, sharegpt)
        if not any(m["role"] == "assistant" for m in chat):
            raise BadRecord("empty_response", "no assistant message")
        return chat

    def _messages(self, msgs: Any, key: str, f: dict[str, str], sharegpt: bool) -> list[dict[str, str]]:
        """Field `key`'s messages as `{"role", "content"}` dicts (ShareGPT roles renamed); raises `BadRecord`."""
        if not isinstance(msgs, list) or not msgs:
            raise BadRecord("missing_field", f"field {key!r} must be a non-empty list")
        chat = []
        for i, m in enumerate(msgs):
            role, content = (m.get(f["role"]), m.get(f["content"])) if isinstance(m, dict) else (None, None)
            if not isinstance(role, str) or not isinstance(content, str):
                raise BadRecord("missing_field", f"{key}[{i}] needs string fields {f['role']!r} and {f['content']!r}")
            if sharegpt:
                if role not in SHAREGPT_ROLES:
                    raise BadRecord("invalid_record", f"{key}[{i}]: unknown role {role!r}")
                role = SHAREGPT_ROLES[role]
            if role == "assistant" and not content.strip():
                raise BadRecord("empty_response", f"{key}[{i}]: empty assistant message")
            chat.append({"role": role, "content": content})
        return chat

    def _apply(self, chat: list[dict[str, str]], generation: bool = False) -> str:
        try:
            return self.tok.apply_chat_template(chat, chat_template=self.template, tokenize=False,
                                                add_generation_prompt=generation)
        except Exception as e:  # jinja raises for chats a template rejects (e.g. roles not alternating)
            raise BadRecord("invalid_record", f"chat template rejects the record ({e})") from e

    def _render_chat(self, chat: list[dict[str, str]]) -> Rendered:
        full = self._apply(chat)
        if self.cfg.train_on_prompt:
            return Rendered(full, [(0, len(full))])
        spans = []
        for i, m in enumerate(chat):
            if m["role"] != "assistant":
                continue
            before, upto = self._apply(chat[:i], generation=True), self._apply(chat[: i + 1])
            if not (full.startswith(before) and full.startswith(upto)):
                raise DataError("the chat template does not render a conversation's prefixes as prefixes of "
                                "the whole, so response tokens cannot be located; set train_on_prompt")
            spans.append((len(before), len(upto)))
        return Rendered(full, spans)

    def tokenize(self, batch: list[Rendered], limit: int | None = None) -> list[Doc]:
        """Tokenize rendered records in batched calls of the fast tokenizer.

        With `limit`, a text longer than that many tokens may come back cut after
        `limit + 1` tokens (`Doc.cut`), its rest never tokenised (see the module docstring).
        """
        encs = self._encode(batch, limit)
        for i, r in enumerate(batch):
            if encs[i] is None:  # the clipped text was not enough: render the record whole (rare)
                batch[i] = r.whole()
                encs[i] = self._encode([batch[i]], limit)[0]
        docs = []
        for r, (e, cut) in zip(batch, encs):
            ids = e.ids[:limit + 1] if cut else e.ids
            if r.add_bos_eos:
                ids = self.bos + ids + ([] if cut else self.eos)
                target = np.ones(len(ids), dtype=bool)
            else:
                off = np.asarray(e.offsets[:len(ids)], dtype=np.int64).reshape(-1, 2)
                ends = np.where(off[:, 1] > off[:, 0], off[:, 1] - 1, -1)  # a token's last character
                target = np.zeros(len(ids), dtype=bool)
                for a, b in r.spans:
                    target |= (ends >= a) & (ends < b)
            docs.append(Doc(np.asarray(ids, dtype=np.int64), target, cut))
        return docs

    def _encode(self, batch: list[Rendered], limit: int | None, special: bool = False) -> list[tuple[Any, bool] | None]:
        """(encoding, cut) per text: whole texts, or prefixes long enough for `limit` tokens;
        None for a clipped text whose exact part is too short for that. `special`: the tokenizer adds its
        special tokens (BOS) as its `__call__` does."""
        out: list[tuple[Any, bool] | None] = [None] * len(batch)
        todo = list(range(len(batch)))
        chars = None if limit is None else char_budget(limit)
        while todo:
            pieces, sizes = [], []
            for i in todo:
                r = batch[i]
                known = len(r.text) if r.exact is None else r.exact
                size = known if chars is None or r.exact is None and known <= chars else min(chars, known)
                pieces.append(r.text if size == len(r.text) else r.text[:size])
                sizes.append((size, known))
            again = []
            for i, (size, known), e in zip(todo, sizes, self.backend.encode_batch(pieces, add_special_tokens=special)):
                cut = size < len(batch[i].text) or batch[i].exact is not None
                if not cut or len(e.ids) >= limit + GUARD_TOKENS:
                    out[i] = (e, cut)
                elif size < known:
                    again.append(i)  # too few tokens in the prefix to trust the first `limit`: a longer one
            todo, chars = again, None if chars is None else 2 * chars
        return out
