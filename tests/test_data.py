"""Data formats and loss masks (token by token), sources of every kind, bad-data policy."""

from __future__ import annotations

import json
import string
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hfmeg.data import DataConfig, SourceConfig, build_data
from hfmeg.data.formats import Formatter
from hfmeg.data.mixing import Mixture
from hfmeg.data.sources import Source
from hfmeg.errors import DataError
from tiny_models import ASSETS

LLAMA2 = ASSETS / "tokenizers" / "llama2"
DATA = ASSETS / "data"


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (ids < 110), plus <pad> <s> </s> as special tokens."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for c in string.printable:
        vocab.setdefault(c, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def llama2_or_skip():
    if not (LLAMA2 / "tokenizer.json").is_file():
        pytest.skip(f"{LLAMA2} is absent (../shared/assets not checked out beside the repo)")
    return AutoTokenizer.from_pretrained(LLAMA2)


def encode(tok, record, fmt="alpaca", fields=None, **cfg):
    """(tokens, targets) of one record, through the real render + tokenize path."""
    config = DataConfig(sources=[SourceConfig("x", format=fmt, fields=fields or {})], **cfg)
    f = Formatter(config, tok)
    (doc,) = f.tokenize([f.render(record, *config.fields_of(config.sources[0]))])
    return tok.convert_ids_to_tokens(doc.ids.tolist()), doc.target.tolist()


def char_expect(*pieces: tuple[str, bool]) -> tuple[list[str], list[bool]]:
    """Expected char-tokenizer tokens/targets from (text, is_target) pieces; <s>/</s> are one token."""
    toks, tgt = [], []
    for text, t in pieces:
        parts = [text] if text in ("<s>", "</s>") else list(text)
        toks += parts
        tgt += [t] * len(parts)
    return toks, tgt


def test_alpaca_masks_token_by_token():
    tok = char_tokenizer()
    rec = {"instruction": "Add 2 and 3.", "input": "", "output": "5"}
    assert encode(tok, rec) == char_expect(("<s>", False), ("### Instruction:\nAdd 2 and 3.\n\n### Response:\n", False),
                                           ("5", True), ("</s>", True))
    rec = {"instruction": "Add.", "input": "2 3", "output": "5", "system": "Be brief."}
    assert encode(tok, rec, system_prompt="ignored: the record has one") == char_expect(
        ("<s>", False), ("Be brief.\n\n### Instruction:\nAdd.\n\n2 3\n\n### Response:\n", False),
        ("5", True), ("</s>", True))
    rec = {"instruction": "Hi", "output": "Yo"}
    toks, tgt = encode(tok, rec, system_prompt="S", train_on_prompt=True)
    assert toks == char_expect(("<s>", 0), ("S\n\n### Instruction:\nHi\n\n### Response:\nYo", 0), ("</s>", 0))[0]
    assert all(tgt)


def test_alpaca_masks_llama2_tokenizer():
    tok = llama2_or_skip()
    toks, tgt = encode(tok, {"instruction": "Hi there", "input": "", "output": "Hello friend"})
    prompt = ["<s>", "##", "#", "▁Inst", "ruction", ":", "<0x0A>", "Hi", "▁there", "<0x0A>", "<0x0A>", "##", "#",
              "▁Response", ":", "<0x0A>"]
    assert list(zip(toks, tgt)) == [(t, False) for t in prompt] + [("Hello", True), ("▁friend", True),
                                                                   ("</s>", True)]
    # the wrapper and the batched backend call tokenize alike
    text = "<s>### Instruction:\nHi there\n\n### Response:\nHello friend</s>"
    assert tok.convert_tokens_to_ids(toks) == tok(text, add_special_tokens=False)["input_ids"]


def test_messages_with_the_tokenizers_chat_template():
    tok = char_tokenizer()
    tok.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}[assistant] {% endif %}")
    rec = {"messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]}
    assert encode(tok, rec, "messages", system_prompt="sys") == char_expect(
        ("[system] sys\n[user] q1\n[assistant] ", False), ("a1\n", True),
        ("[user] q2\n[assistant] ", False), ("a2\n", True))


def test_sharegpt_default_template_multi_turn():
    tok = char_tokenizer()
    rec = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "q1"},
                             {"from": "gpt", "value": "a1"}, {"from": "human", "value": "q2"},
                             {"from": "gpt", "value": "a2"}]}
    assert encode(tok, rec, "sharegpt") == char_expect(
        ("<s>", False), ("S\n\n### Instruction:\nq1\n\n### Response:\n", False), ("a1", True), ("</s>", True),
        ("### Instruction:\nq2\n\n### Response:\n", False), ("a2", True), ("</s>", True))


def test_text_format_and_field_mapping():
    tok = char_tokenizer()
    toks, tgt = encode(tok, {"content": "ab c"}, "text", fields={"text": "content"})
    assert (toks, tgt) == char_expect(("<s>", True), ("ab c", True), ("</s>", True))
    assert encode(tok, {"q": "1+1", "a": "2"}, fields={"instruction": "q", "output": "a"}) == char_expect(
        ("<s>", False), ("### Instruction:\n1+1\n\n### Response:\n", False), ("2", True), ("</s>", True))
    with pytest.raises(DataError, match="unknown field 'question'"):
        DataConfig(sources=[SourceConfig("x", fields={"question": "q"})])


RECORDS = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(7)]


def write_jsonl(path: Path, recs) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in recs))
    return path


def read(src: SourceConfig, start: int = 0):
    raws = list(Source(src).records(0, start))
    assert all(r.problem is None for r in raws)
    return [r.record for r in raws], [r.where for r in raws]


def test_local_sources_of_every_kind_resume_by_index(tmp_path):
    import datasets

    (tmp_path / "arr.json").write_text(json.dumps(RECORDS, indent=1))
    write_jsonl(tmp_path / "lines.jsonl", RECORDS)
    datasets.Dataset.from_list(RECORDS).to_parquet(tmp_path / "t.parquet")
    folder = tmp_path / "dir"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", RECORDS[:3])
    write_jsonl(folder / "b.jsonl", [RECORDS[3], {}, RECORDS[4]][:1] + RECORDS[4:])
    (folder / "notes.md").write_text("ignored: not a data file")
    for path in ["arr.json", "lines.jsonl", "t.parquet", "dir", "dir/*.jsonl"]:
        for start in (0, 2, 5, 7):
            recs, where = read(SourceConfig(str(tmp_path / path)), start)
            assert recs == RECORDS[start:], (path, start)
    assert read(SourceConfig(str(tmp_path / "lines.jsonl")), 5)[1] == [f"{tmp_path}/lines.jsonl:6",
                                                                        f"{tmp_path}/lines.jsonl:7"]
    assert read(SourceConfig(str(tmp_path / "dir")), 4)[1][0] == f"{folder}/b.jsonl:2"
    (tmp_path / "c.txt").write_text("first doc\n\n  \nsecond doc\n")
    assert read(SourceConfig(str(tmp_path / "c.txt"))) == (
        [{"text": "first doc"}, {"text": "second doc"}], [f"{tmp_path}/c.txt:1", f"{tmp_path}/c.txt:4"])
    assert read(SourceConfig(str(tmp_path / "c.txt")), 1)[0] == [{"text": "second doc"}]


def test_hub_source_streams_with_config_split_revision(monkeypatch):
    import datasets

    calls = []

    def fake_load(path, name=None, *, split=None, revision=None, streaming=False, **kw):
        calls.append((path, name, split, revision, streaming, kw))
        return datasets.Dataset.from_list(RECORDS).to_iterable_dataset()

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    src = SourceConfig("some-org/sft-set", config="en", split="validation", revision="abc123")
    recs, where = read(src, 3)
    assert recs == RECORDS[3:] and where[0] == "some-org/sft-set[en]:validation#3"
    assert calls == [("some-org/sft-set", "en", "validation", "abc123", True, {})]
    data = build_data(DataConfig(sources=[src], seq_len=64), char_tokenizer(), dp_rank=0, dp_size=1,
                      micro_batch_size=1, global_batch_size=2)
    assert next(data).num_tokens > 0 and data.report.documents >= 2


def test_weighted_mixture_is_deterministic_resumable_and_cycles(tmp_path):
    a = SourceConfig(str(write_jsonl(tmp_path / "a.jsonl", RECORDS)), weight=3.0)
    b = SourceConfig(str(write_jsonl(tmp_path / "b.jsonl", RECORDS[:2])), weight=1.0)
    sources = [Source(a), Source(b)]
    run = list(zip(range(3000), Mixture(sources, seed=5)))
    picks = np.array([c for _, (c, _, _) in run])
    assert abs((picks == 0).mean() - 0.75) < 0.04
    assert [c for _, (c, _, _) in zip(range(3000), Mixture(sources, seed=6))] != picks.tolist()
    # every source cycles through its records, epoch after epoch (in file order: these Sources do not shuffle)
    assert [r.record for _, (c, r, _) in run if c == 1][:5] == [RECORDS[0], RECORDS[1], RECORDS[0], RECORDS[1],
                                                                 RECORDS[0]]
    pos = run[1999][1][2]
    assert pos.draws == 2000 and sum(pos.index) + 7 * pos.epochs[0] + 2 * pos.epochs[1] == 2000
    resumed = [(c, r.where) for _, (c, r, _) in zip(range(1000), Mixture(sources, seed=5, position=pos))]
    assert resumed == [(c, r.where) for _, (c, r, _) in run[2000:]]


def bad_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "bad.jsonl", [
        RECORDS[0],
        '{"instruction": "broken"',
        "[1, 2]",
        {"instruction": "no output"},
        {"instruction": "number", "output": 5},
        {"instruction": "empty", "output": "   "},
        "",
        {"instruction": "long " * 30, "output": "ok"},
        RECORDS[1],
    ])


def run_data(src: SourceConfig, rows: int = 4, **cfg):
    """The first batch and the report, records in file order (the cases the tests name are the first ones)."""
    data = build_data(DataConfig(sources=[src], shuffle=False, **cfg), char_tokenizer(), dp_rank=0, dp_size=1,
                      micro_batch_size=1, global_batch_size=rows)
    return next(data), data.report


def test_bad_data_is_counted_and_named(tmp_path):
    path = bad_file(tmp_path)
    _, rep = run_data(SourceConfig(str(path)), rows=2, seq_len=64, packing=False)  # one epoch
    assert rep.counts == {"malformed_json": 2, "missing_field": 2, "empty_response": 1, "overlong": 1}
    assert rep.first["malformed_json"].startswith(f"{path}:2: malformed JSON")
    assert rep.first["missing_field"] == f"{path}:4: missing field 'output'"
    assert rep.first["empty_response"] == f"{path}:6: empty field 'output'"
    assert rep.first["overlong"].startswith(f"{path}:8: 187 tokens > seq_len 64; no response token left")
    assert "malformed_json: 2" in rep.summary()
    _, again = run_data(SourceConfig(str(path)), rows=8, seq_len=64, packing=False)  # four epochs: same records
    assert again.counts == rep.counts
    with pytest.raises(DataError, match=f"{path}:2: malformed JSON"):
        run_data(SourceConfig(str(path)), seq_len=64, bad_data="fail")
    with pytest.raises(DataError, match="m.jsonl:2: missing field .output. \\(missing_field"):
        run_data(SourceConfig(str(write_jsonl(tmp_path / "m.jsonl", [RECORDS[0], {"instruction": "x"}]))),
                 bad_data="fail")


def test_overlong_truncate_drop_split(tmp_path):
    rec = {"instruction": "q", "output": "x" * 100}  # 35 prompt tokens + 101 targets
    src = SourceConfig(str(write_jsonl(tmp_path / "long.jsonl", [rec])))
    batch, rep = run_data(src, rows=1, seq_len=64, packing=False)
    row = batch.microbatches[0]
    assert rep.counts == {"overlong": 1} and "136 tokens > seq_len 64; truncated" in rep.first["overlong"]
    x = char_tokenizer().convert_tokens_to_ids("x")
    assert (row.segment_ids == 1).all() and (row.input_ids[0, 35:] == x).all()
    assert (row.labels[0, :34] == -100).all() and (row.labels[0, 34:63] == x).all()
    assert row.labels[0, 63] == -100  # the document's (truncated) end
    with pytest.raises(DataError, match="136 tokens > seq_len 64; dropped"):
        run_data(src, seq_len=64, overlong="drop", bad_data="fail")
    text = SourceConfig(str(write_jsonl(tmp_path / "t.jsonl", [{"text": "y" * 150}])), format="text")
    batch, rep = run_data(text, seq_len=64, overlong="split", packing=False)
    lengths = [int((m.segment_ids == 1).sum()) for m in batch.microbatches]
    assert lengths == [64, 64, 24, 64]  # 152 tokens -> 64 + 64 + 24; row 4 starts the next epoch
    assert rep.counts == {} and rep.documents == 6  # pieces read: the whole second epoch is in the packer


def test_bad_chats_and_unusable_sources(tmp_path):
    chats = write_jsonl(tmp_path / "c.jsonl", [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        {"conversations": []},
        {"conversations": [{"from": "robot", "value": "beep"}, {"from": "gpt", "value": "x"}]},
        {"conversations": [{"from": "human", "value": "only a question"}]},
        {"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]},
    ])
    _, rep = run_data(SourceConfig(str(chats), format="sharegpt"), rows=2, seq_len=64, packing=False)
    assert rep.counts == {"missing_field": 2, "invalid_record": 1, "empty_response": 1}
    assert rep.first["invalid_record"] == f"{chats}:3: conversations[0]: unknown role 'robot'"
    assert rep.first["empty_response"] == f"{chats}:4: no assistant message"
    (tmp_path / "bad.json").write_text('[{"instruction": "a", "output": "b"},')
    with pytest.raises(DataError, match="bad.json: malformed JSON array"):
        run_data(SourceConfig(str(tmp_path / "bad.json")))
    with pytest.raises(DataError, match="no such file"):
        run_data(SourceConfig(str(tmp_path / "missing.jsonl")))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty.jsonl: no records"):
        run_data(SourceConfig(str(tmp_path / "empty.jsonl")))
    allbad = write_jsonl(tmp_path / "allbad.jsonl", [{"instruction": "x"}, "{oops"])
    with pytest.raises(DataError, match="no usable record in a whole epoch"):
        run_data(SourceConfig(str(allbad)))


def test_text_with_the_stories260k_tokenizer():
    from helpers import stories_or_skip

    tok = AutoTokenizer.from_pretrained(stories_or_skip())
    own = Path(__file__).resolve().parents[1] / "data" / "text_sample.txt"
    cfg = DataConfig(sources=[SourceConfig(str(own), format="text")], seq_len=256, shuffle=False)
    batch = next(build_data(cfg, tok, dp_rank=0, dp_size=1, micro_batch_size=2, global_batch_size=2))
    lines = own.read_text().splitlines()
    k = 0
    for m in batch.microbatches:
        for ids, labels, seg in zip(m.input_ids, m.labels, m.segment_ids):
            for s in range(1, int(seg.max()) + 1):
                doc, lab = ids[seg == s], labels[seg == s]
                assert doc[0] == tok.bos_token_id and doc[-1] == tok.eos_token_id
                assert tok.decode(doc[1:-1]) == lines[k] and torch.equal(lab[:-1], doc[1:])
                k += 1
    assert k >= 4 and int(batch.microbatches[0].input_ids.max()) < 512
