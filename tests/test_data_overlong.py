"""Overlong records are cut before tokenising: same tokens as tokenising in full, bounded work."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hfmeg.data import DataConfig, SourceConfig, build_data
from hfmeg.data import formats
from hfmeg.data.formats import Formatter
from test_data import DATA, char_tokenizer, llama2_or_skip, write_jsonl


def byte_level_bpe(text: str) -> PreTrainedTokenizerFast:
    """A GPT-2-style tokenizer (regex pre-tokenizer + byte-level BPE) trained on `text`."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(text.splitlines(), trainers.BpeTrainer(
        vocab_size=2000, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")


def hard_texts(prose: str) -> list[str]:
    """Prose from several offsets, indented code (runs of spaces), and one 30k-character word."""
    code = "".join(f"{'    ' * (i % 6)}if x{i} == {i}:\n{'    ' * (i % 6 + 1)}y += {i * 7}\n\n" for i in range(900))
    blob = "".join(chr(97 + (i * i + 7 * i) % 26) for i in range(30_000))
    return [prose[i:i + 40_000] for i in (0, 12_345, 300_001)] + [code, blob]


@pytest.mark.parametrize("kind", ["llama2", "byte_level_bpe"])
def test_cut_tokens_equal_full_tokenisation_then_truncation(kind, monkeypatch):
    if not (DATA / "wiki_demo.txt").is_file():
        pytest.skip(f"{DATA} is absent (../shared/assets not checked out beside the repo)")
    prose = (DATA / "wiki_demo.txt").read_text()
    tok = llama2_or_skip() if kind == "llama2" else byte_level_bpe(prose[:300_000])
    cfg = DataConfig(sources=[SourceConfig("x")])
    f = Formatter(cfg, tok)
    fields = cfg.fields_of(cfg.sources[0])[1]
    records = [({"instruction": "Summarise.", "output": t}, "alpaca", fields) for t in hard_texts(prose)]
    records += [({"text": t}, "text", {"text": "text"}) for t in hard_texts(prose)]
    full = f.tokenize([f.render(*r) for r in records])
    cuts = 0
    # 3 characters a token: prefixes end just past the guard tokens, where a cut could change tokens
    for chars_per_token in (3, formats.CHARS_PER_TOKEN):
        monkeypatch.setattr(formats, "CHARS_PER_TOKEN", chars_per_token)
        for limit in list(range(8, 1200, 53)) + [2048]:  # each limit cuts every text at another character
            for whole, cut in zip(full, f.tokenize([f.render(*r, limit) for r in records], limit)):
                assert len(cut.ids) == len(cut.target) and len(cut.ids) > limit
                assert (cut.ids[:limit] == whole.ids[:limit]).all()
                assert (cut.target[:limit] == whole.target[:limit]).all()
                cuts += cut.cut
    assert cuts > 400  # most cases really were cut


class CountingBackend:
    """The fast tokenizer, counting the characters it is asked to tokenise."""

    def __init__(self, backend):
        self.backend, self.chars = backend, 0

    def encode_batch(self, texts, **kw):
        self.chars += sum(len(t) for t in texts)
        return self.backend.encode_batch(texts, **kw)


def test_a_huge_record_costs_what_a_seq_len_record_costs(tmp_path):
    huge = {"instruction": "q", "output": "x" * 3_400_000}
    src = SourceConfig(str(write_jsonl(tmp_path / "h.jsonl", [{"instruction": "a", "output": "b"}, huge])))
    data = build_data(DataConfig(sources=[src], seq_len=64, packing=False, read_ahead=2, prefetch=0),
                      char_tokenizer(), dp_rank=0, dp_size=1, micro_batch_size=1, global_batch_size=2)
    counter = data.formatter.backend = CountingBackend(data.formatter.backend)
    rendered = []
    apply = data.formatter._apply
    data.formatter._apply = lambda chat, generation=False: rendered.append(apply(chat, generation)) or rendered[-1]
    row = next(data).microbatches[1]
    assert counter.chars < 2_000  # the record's first 8 x (64 + 64) characters, plus the small record
    assert max(len(t) for t in rendered) < 5_000  # its output was clipped to 4 x 8 x (64 + 64) before rendering
    assert (row.segment_ids == 1).all() and int((row.labels != -100).sum()) == 29  # 35 prompt tokens
    assert data.report.counts == {"overlong": 1}
    assert "over 65 tokens > seq_len 64; truncated" in data.report.first["overlong"]


def test_a_normalizer_that_deletes_text_makes_the_prefix_grow():
    tok = char_tokenizer()
    tok.backend_tokenizer.normalizer = normalizers.Replace(" ", "")  # 100k spaces tokenise to nothing
    cfg = DataConfig(sources=[SourceConfig("x", format="text")], seq_len=64)
    f = Formatter(cfg, tok)
    f.backend = CountingBackend(f.backend)
    rec = {"text": " " * 100_000 + "y" * 1_000_000}
    (cut,) = f.tokenize([f.render(rec, "text", {"text": "text"}, 64)], 64)
    # prefixes of 1k, 2k, 4k characters of the text clipped to 4k, then of the whole: 1k ... 128k
    assert cut.cut and f.backend.chars < 300_000
    (whole,) = f.tokenize([f.render(rec, "text", {"text": "text"})])
    assert (cut.ids[:64] == whole.ids[:64]).all() and len(whole.ids) == 1_000_002
