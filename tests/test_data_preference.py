"""Preference pairs: TRL's token ids for every layout, truncation and bad pairs counted by kind, pair packing
into `PairBatch` micro-batches (sequence ids, counts, layout invariance, CP), exact resume, eval, errors."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hfmeg.data import DataConfig, SourceConfig, build_data, build_eval_data
from hfmeg.data.formats import DEFAULT_CHAT_TEMPLATE, BadRecord
from hfmeg.data.microbatch import PairBatch, token_index
from hfmeg.data.preference import PairFormatter
from hfmeg.errors import DataError, LayoutError
from test_data import DATA, char_tokenizer, llama2_or_skip, write_jsonl
from test_data_batches import dp_loaders
from tiny_models import ASSETS

LLAMA3 = ASSETS / "tokenizers" / "llama3" / "tokenizer.model"
LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                   "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
                   "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
KEYS = ("input_ids", "labels", "position_ids", "segment_ids", "sequence_ids")

STRINGS = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
           {"prompt": "Q: 2+2?\nA:", "chosen": "4", "rejected": "five, I think"},
           {"prompt": "Naïve café", "chosen": "s are nice", "rejected": " is closed</s>"},  # merges; EOS given
           {"prompt": "x " * 40, "chosen": "tail " * 30, "rejected": "end " * 3}]
IMPLICIT_STRINGS = [{"chosen": "The sky is blue.", "rejected": "The sky is green."},
                    {"chosen": "Once upon a time", "rejected": "Once upon a time there was"}]  # one a prefix
USER = {"role": "user", "content": "What colour is the sky?"}
CHATS = [{"prompt": [USER], "chosen": [{"role": "assistant", "content": "Blue."}],
          "rejected": [{"role": "assistant", "content": "Green, " * 30}]},
         {"prompt": [{"role": "system", "content": "Be brief."}, USER, {"role": "assistant", "content": "Blue."},
                     {"role": "user", "content": "Sure?"}],
          "chosen": [{"role": "assistant", "content": "Yes."}], "rejected": [{"role": "assistant", "content": "No"}]}]
IMPLICIT_CHATS = [{"chosen": [USER, {"role": "assistant", "content": "Blue."}],
                   "rejected": [USER, {"role": "assistant", "content": "Red."}]}]


def llama3_or_skip():
    """The LLaMA-3 tokenizer, converted from the asset's tiktoken ranks by transformers' converter (its own
    reader needs `tiktoken`; the file is base64 token, rank per line), with BOS added as Meta's tokenizer does."""
    if not LLAMA3.is_file():
        pytest.skip(f"{LLAMA3} is absent (../shared/assets not checked out beside the repo)")
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class Ranks(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(path):
            return {base64.b64decode(t): int(r) for t, r in (line.split() for line in open(path, "rb") if line.strip())}

    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
               "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    special += [f"<|reserved_special_token_{i}|>" for i in range(2, 247)]
    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    tk = Ranks(vocab_file=str(LLAMA3), pattern=pattern, extra_special_tokens=special).converted()
    tk.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 128000)])])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    tok.chat_template = LLAMA3_TEMPLATE
    assert tok("Hello world")["input_ids"] == [128000, 9906, 1917]  # the README's ids
    return tok


@pytest.fixture(scope="module", params=["llama2", "llama3"])
def tokenizer(request):
    if request.param == "llama3":
        return llama3_or_skip()
    tok = llama2_or_skip()
    tok.chat_template = DEFAULT_CHAT_TEMPLATE  # what hfmeg falls back to; TRL needs it on the tokenizer
    return tok


def hfmeg_pairs(tok, records, seq_len, fmt="preference"):
    """Per record: (chosen doc, rejected doc) or the problem kind, through PairFormatter in one batch."""
    cfg = DataConfig(sources=[SourceConfig("x", format=fmt)], seq_len=seq_len)
    f = PairFormatter(cfg, tok)
    texts = [f.render(r, *cfg.fields_of(cfg.sources[0])) for r in records]
    return [docs or problem[0] for docs, problem in f.pairs(texts, seq_len)]


def trl_pairs(tok, records, max_length):
    """TRL's own preparation (`DPOTrainer._prepare_dataset`, trl 1.16) and collation of the records: per kept
    record, its two sequences and completion masks, and its prompt/chosen/rejected ids."""
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl.trainer.dpo_trainer")
    datasets.disable_progress_bars()
    args = SimpleNamespace(dataset_num_proc=None, max_length=max_length, truncation_mode="keep_start")
    ds = trl.DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tok), datasets.Dataset.from_list(records), tok,
                                         args, "train")
    collate = trl.DataCollatorForPreference(pad_token_id=0, max_length=max_length)
    out = []
    for ex in ds:
        b = collate([ex])
        seqs = [(ids[m == 1].tolist(), c[m == 1].bool().tolist())
                for ids, m, c in zip(b["input_ids"], b["attention_mask"], b["completion_mask"])]
        out.append((seqs, ex["prompt_ids"], ex["chosen_ids"], ex["rejected_ids"]))
    return out


def assert_like_trl(tok, records, seq_len, fmt="preference", trl_records=None):
    ours = hfmeg_pairs(tok, records, seq_len, fmt)
    kept = [p for p in ours if not isinstance(p, str)]
    assert {p for p in ours if isinstance(p, str)} <= {"prompt_too_long"}  # the only pairs TRL drops too
    theirs = trl_pairs(tok, trl_records or records, seq_len)
    assert len(kept) == len(theirs) > 0
    for docs, (seqs, prompt, chosen, rejected) in zip(kept, theirs):
        for d, (ids, completion), answer in zip(docs, seqs, (chosen, rejected)):
            assert d.ids.tolist() == ids and d.target.tolist() == completion
            if len(prompt) + len(answer) <= seq_len:  # untruncated: the very ids TRL's dataset holds
                start = int(d.target.argmax())
                assert start == len(prompt) and d.ids.tolist() == prompt + answer
    return ours


@pytest.mark.parametrize("seq_len", [4096, 40])
def test_string_and_conversational_pairs_have_trls_token_ids(tokenizer, seq_len):
    """Strings (EOS appended, BOS from the tokenizer, tokens merging across the prompt's end), TRL's implicit
    prompt (strings and chats), chats through the template; at 40 tokens some answers are cut (keep_start)."""
    for records in (STRINGS, IMPLICIT_STRINGS, CHATS, IMPLICIT_CHATS):
        ours = assert_like_trl(tokenizer, records, seq_len)
        if seq_len == 40 and records is STRINGS:  # "x " * 40 alone fills 40 tokens: dropped, as TRL drops it
            assert ours[3] == "prompt_too_long"
        if seq_len == 40 and records is CHATS:
            assert max(len(d.ids) for d in ours[0]) == 40  # the long rejected answer was cut


@pytest.mark.parametrize("seq_len", [4096, 300])
def test_sharegpt_asset_pairs_have_trls_token_ids(tokenizer, seq_len):
    """dpo_en_demo.json (LLaMA-Factory's layout: `conversations`, one `chosen` and one `rejected` message, in
    from/value form) against TRL given the same pairs in its conversational layout."""
    path = DATA / "dpo_en_demo.json"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    records = json.loads(path.read_text())[:10]
    roles = {"human": "user", "gpt": "assistant", "system": "system"}

    def chat(msgs):
        return [{"role": roles[m["from"]], "content": m["value"]} for m in msgs]

    trl_records = [{"prompt": chat(r["conversations"]), "chosen": chat([r["chosen"]]),
                    "rejected": chat([r["rejected"]])} for r in records]
    ours = assert_like_trl(tokenizer, records, seq_len, "sharegpt_preference", trl_records)
    if seq_len == 300:
        assert "prompt_too_long" in ours and any(len(d.ids) == 300 for p in ours if p != "prompt_too_long" for d in p)


def pair_file(tmp_path: Path, n: int = 40) -> Path:
    """n string pairs of varied lengths (char tokenizer: one token per character)."""
    recs = [{"prompt": f"p{i}:" + "q" * (i % 7), "chosen": "yes" + "a" * (i % 11), "rejected": "no" + "b" * (i % 5)}
            for i in range(n)]
    return write_jsonl(tmp_path / "pairs.jsonl", recs)


def pair_config(path, **cfg) -> DataConfig:
    """Preference data in file order (the tests name the pairs by their records)."""
    return DataConfig(sources=[SourceConfig(str(path))], format="preference", seq_len=cfg.pop("seq_len", 64),
                      read_ahead=cfg.pop("read_ahead", 5), shuffle=cfg.pop("shuffle", False), **cfg)


def loader(path, dp=1, rank=0, mbs=2, gbs=8, cp=1, cp_rank=0, **cfg):
    return build_data(pair_config(path, **cfg), char_tokenizer(), dp_rank=rank, dp_size=dp, micro_batch_size=mbs,
                      global_batch_size=gbs, cp_rank=cp_rank, cp_size=cp)


def text(pair):
    """A pair's label tokens as the char tokenizer's text."""
    return tuple("".join(char_tokenizer().convert_ids_to_tokens(ids)) for ids in pair)


def check_pairs(mb: PairBatch) -> list[tuple[list[int], list[int]]]:
    """A micro-batch's invariants; its pairs as (chosen label tokens, rejected label tokens)."""
    assert isinstance(mb, PairBatch) and mb.ref_logps is None
    counted = mb.labels != -100
    assert torch.equal(mb.sequence_ids != -1, counted)
    seqs = mb.sequence_ids
    assert sorted(seqs[counted].unique().tolist()) == list(range(2 * mb.num_pairs))
    pairs = []
    for p in range(mb.num_pairs):
        both = []
        for s, parity in ((2 * p, 0), (2 * p + 1, 1)):
            rows, cols = (seqs == s).nonzero(as_tuple=True)
            assert len(rows.unique()) == 1 and int(rows[0]) % 2 == parity  # chosen rows even, rejected odd
            segment = mb.segment_ids[rows[0], cols]
            assert len(segment.unique()) == 1  # one document, and the whole of its answer:
            doc = mb.segment_ids[rows[0]] == segment[0]
            assert int(counted[rows[0]][doc].sum()) == len(cols) and len(cols) > 0
            both.append(mb.labels[rows, cols].tolist())
        assert int(rows[0]) == int((seqs == 2 * p).nonzero()[0, 0]) + 1  # the rejected row follows the chosen
        pairs.append(tuple(both))
    return pairs


def global_pairs(path, dp, mbs, gbs, steps, state=None, **cfg):
    """Per step: every pair of the global batch (all DP ranks, in order), the rows, and the step's counts."""
    loaders = dp_loaders(pair_config(path, **cfg), dp, mbs, gbs, state)
    out = []
    for _ in range(steps):
        batches = [next(d) for d in loaders]
        b = batches[0]
        assert len({(x.num_tokens, x.num_pairs, x.chosen_tokens) for x in batches}) == 1
        micro = [m for x in batches for m in x.microbatches]
        pairs = [p for m in micro for p in check_pairs(m)]
        assert b.num_pairs == len(pairs) == sum(m.num_pairs for m in micro)
        assert b.num_tokens == sum(m.label_tokens() for m in micro) == sum(len(c) + len(r) for c, r in pairs)
        assert b.chosen_tokens == sum(len(c) for c, _ in pairs)
        rows = {k: torch.cat([getattr(m, k) for m in micro]) for k in KEYS[:4]}
        out.append((pairs, rows))
    states = [d.state_dict() for d in loaders]
    assert all(s == states[0] for s in states)
    return out, states[0], loaders[0].report


def test_pairs_pack_into_row_pairs_the_same_for_any_dp_and_micro_batch(tmp_path):
    path = pair_file(tmp_path)
    for packing in (True, False):
        ref, _, _ = global_pairs(path, dp=1, mbs=8, gbs=8, steps=3, packing=packing)
        for dp, mbs in ((2, 2), (4, 2), (2, 4)):
            got, _, _ = global_pairs(path, dp=dp, mbs=mbs, gbs=8, steps=3, packing=packing)
            for (pairs, rows), (ref_pairs, ref_rows) in zip(got, ref):
                assert pairs == ref_pairs and all(torch.equal(rows[k], ref_rows[k]) for k in rows)
        seg = ref[0][1]["segment_ids"]
        assert (int(seg.max()) > 1) == packing  # several pairs per row pair only when packing
        if not packing:
            assert all(len(pairs) == 4 for pairs, _ in ref)  # one pair per row pair: 8 rows, 4 pairs
    # the pairs, in order, are the records' answers (with EOS): none lost, reordered or mixed up
    assert [text(p) for p in ref[0][0][:2]] == [("yes</s>", "no</s>"), ("yesa</s>", "nob</s>")]


def test_cp_ranks_cut_the_sequence_ids_of_the_same_rows(tmp_path):
    path = pair_file(tmp_path)
    whole = next(loader(path, seq_len=64)).microbatches[0]
    for r in range(2):
        part = next(loader(path, seq_len=64, cp=2, cp_rank=r)).microbatches[0]
        cols = token_index(64, 2, r)
        assert part.num_pairs == whole.num_pairs and torch.equal(part.sequence_ids, whole.sequence_ids[:, cols])


def test_exact_resume_at_another_dp_size_and_eval_split(tmp_path):
    path = pair_file(tmp_path)
    for packing in (True, False):
        ref, _, ref_report = global_pairs(path, dp=1, mbs=4, gbs=8, steps=6, packing=packing, eval_split=5)
        first, state, _ = global_pairs(path, dp=2, mbs=2, gbs=8, steps=2, packing=packing, eval_split=5)
        assert state["step"] == 2 and (any(state["packer"]["open"]) or not packing)
        rest, _, report = global_pairs(path, dp=4, mbs=2, gbs=8, steps=4, state=state, packing=packing,
                                       eval_split=5)
        assert [p for p, _ in first + rest] == [p for p, _ in ref]
        assert report.documents == ref_report.documents
    evals = list(build_eval_data(pair_config(path, eval_split=5), char_tokenizer(), dp_rank=0, dp_size=1, micro_batch_size=2,
                                 global_batch_size=4))
    pairs = [p for b in evals for m in b.microbatches for p in check_pairs(m)]
    assert len(pairs) == sum(b.num_pairs for b in evals) == 5  # the held-out records, as pairs
    held = np.random.default_rng(0).permutation(40)[:5]  # the eval split's records, every answer token a label
    assert [text(p) for p in pairs] == [(f"yes{'a' * (i % 11)}</s>", f"no{'b' * (i % 5)}</s>") for i in held]


def test_truncation_and_bad_pairs_are_counted_by_kind(tmp_path):
    recs = [{"prompt": "a", "chosen": "good", "rejected": "bad"},
            {"prompt": "a", "chosen": "  ", "rejected": "bad"},  # empty answer
            {"prompt": "a", "rejected": "bad"},  # missing answer
            {"prompt": "a", "chosen": "same", "rejected": "same"},  # no preference
            {"prompt": "p" * 20, "chosen": "x", "rejected": "y"},  # the prompt fills seq_len 20
            {"prompt": "a", "chosen": "c" * 30, "rejected": "r"},  # cut to 20 tokens, kept
            {"prompt": "q", "chosen": [{"role": "assistant", "content": "hi"}], "rejected": "no"}]  # mixed
    data = loader(write_jsonl(tmp_path / "bad.jsonl", recs), seq_len=20, gbs=2, prefetch=0)
    b = next(data)
    assert [text(p) for p in check_pairs(b.microbatches[0])] == [("good</s>", "bad</s>")]
    b = next(data)
    (chosen, rejected), = [text(p) for p in check_pairs(b.microbatches[0])]
    assert chosen == "c" * 19 and rejected == "r</s>"  # "a" + 19 of the 30 c's: 20 tokens, the EOS cut off
    counts = data.report.counts
    assert counts == {"empty_response": 1, "missing_field": 1, "identical_answers": 1, "prompt_too_long": 1,
                      "truncated_answer": 1, "invalid_record": 1}
    assert "bad.jsonl:5" in data.report.first["prompt_too_long"]
    with pytest.raises(DataError, match="bad.jsonl:2: empty field 'chosen'"):
        next(loader(write_jsonl(tmp_path / "bad.jsonl", recs), seq_len=20, gbs=2, bad_data="fail"))


def test_sft_data_or_odd_micro_batches_are_refused_in_one_line(tmp_path):
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"instruction": "hi", "output": "there"}] * 3)
    with pytest.raises(DataError, match=r"sft\.jsonl.*missing field 'chosen'") as e:
        next(loader(sft))
    assert "\n" not in str(e.value)
    with pytest.raises(LayoutError, match="micro_batch_size 1 is odd"):
        loader(pair_file(tmp_path), mbs=1, gbs=2)
    with pytest.raises(DataError, match="mix preference pairs"):
        DataConfig(sources=[SourceConfig("a.jsonl", format="preference"), SourceConfig("b.jsonl")])
    with pytest.raises(DataError, match="overlong"):
        DataConfig(sources=[SourceConfig("a.jsonl")], format="preference", overlong="split")
    with pytest.raises(BadRecord, match="'prompt' is list but the answers are strings"):
        PairFormatter(DataConfig(format="preference"), char_tokenizer()).render(
            {"prompt": [], "chosen": "a", "rejected": "b"}, *DataConfig(format="preference").fields_of(
                SourceConfig("x")))
