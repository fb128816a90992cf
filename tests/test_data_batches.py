"""Packing against a real model, layout-invariant DP slices, exact resume, eval data."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bounds import assert_close, rounding_bound
from helpers import make_ps
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.data import DataConfig, MicroBatch, SourceConfig, build_data, build_eval_data
from hfmeg.data.microbatch import token_index
from hfmeg.data.sources import Source
from hfmeg.errors import DataError
from test_data import RECORDS, bad_file, char_tokenizer, llama2_or_skip, write_jsonl
from tiny_models import save_tiny

OWN = Path(__file__).resolve().parents[1] / "data"
KEYS = ("input_ids", "labels", "position_ids", "segment_ids")  # the per-token fields the data pipeline fills


def mixed_config(tmp_path: Path, **kw) -> DataConfig:
    """The project's own SFT and text samples mixed 2:1, plus a file with bad records."""
    return DataConfig(sources=[SourceConfig(str(OWN / "sft_sample.jsonl"), weight=2.0),
                               SourceConfig(str(OWN / "text_sample.txt"), format="text", weight=1.0),
                               SourceConfig(str(bad_file(tmp_path)), weight=0.5)],
                      seq_len=kw.pop("seq_len", 512), read_ahead=kw.pop("read_ahead", 5), **kw)


def dp_loaders(cfg, dp: int, mbs: int, gbs: int, state=None) -> list:
    """Every DP rank's loader (char tokenizer), resumed from `state` (through JSON) when given."""
    tok = char_tokenizer()
    loaders = [build_data(cfg, tok, dp_rank=r, dp_size=dp, micro_batch_size=mbs, global_batch_size=gbs)
               for r in range(dp)]
    for d in loaders if state is not None else []:
        d.load_state_dict(json.loads(json.dumps(state)))
    return loaders


def global_batches(cfg, dp: int, mbs: int, gbs: int, steps: int, state=None):
    """Per step: the DP slices of all ranks concatenated in rank order, and num_tokens; plus final states."""
    loaders = dp_loaders(cfg, dp, mbs, gbs, state)
    out = []
    for _ in range(steps):
        batches = [next(d) for d in loaders]
        assert len({b.num_tokens for b in batches}) == 1
        micro = [m for b in batches for m in b.microbatches]
        assert len(micro) == gbs // mbs and all(m.shape == (mbs, cfg.seq_len) for m in micro)
        out.append((MicroBatch(**{k: torch.cat([getattr(m, k) for m in micro]) for k in KEYS}), batches[0].num_tokens))
    states = [d.state_dict() for d in loaders]
    assert all(s == states[0] for s in states)  # the data state is layout-free: any rank may save it
    return out, states[0], loaders[0].report


def assert_same(a, b):
    assert len(a) == len(b)
    for (x, nx), (y, ny) in zip(a, b):
        assert nx == ny == x.label_tokens()
        for k in KEYS:
            assert torch.equal(getattr(x, k), getattr(y, k)), k


@pytest.mark.parametrize("kind", ["llama3", "gpt2"])
def test_packed_loss_equals_unpacked_document_losses(tmp_path, kind):
    folder = save_tiny(kind, tmp_path / kind)
    model = load_chunks(HFCheckpoint(folder), make_ps(world=1))[0]
    exact = load_chunks(HFCheckpoint(folder), make_ps(world=1), dtype=torch.float64)[0]  # for the bounds
    texts = tmp_path / "t.txt"
    texts.write_text("".join(f"story {i}: " + "ab " * i + "\n" for i in range(9)))
    cfg = DataConfig(sources=[SourceConfig(str(write_jsonl(tmp_path / "r.jsonl", RECORDS))),
                              SourceConfig(str(texts), format="text")], seq_len=120)
    ((row, _),), _, _ = global_batches(cfg, dp=1, mbs=2, gbs=2, steps=1)
    seg = row.segment_ids
    assert int(seg.max()) >= 3  # several documents per row
    with torch.no_grad():
        packed = model(row.input_ids, position_ids=row.position_ids, segment_ids=seg, labels=row.labels)
        packed64 = exact(row.input_ids, position_ids=row.position_ids, segment_ids=seg, labels=row.labels)
        leaky = model(row.input_ids, labels=row.labels)  # no document mask: attention crosses documents
        assert (packed[seg == 0] == 0).all()
        total = torch.zeros(())
        for b in range(2):
            for k in range(1, int(seg[b].max()) + 1):
                ids, labels = row.input_ids[b][seg[b] == k], row.labels[b][seg[b] == k]
                assert labels[-1] == -100 and torch.equal(ids[1:][labels[:-1] != -100], labels[labels != -100])
                alone = model(ids[None], labels=labels[None])[0]
                # fp32 in two orders (one row of documents, each document alone): rounding of the float64 run
                assert_close(packed[b][seg[b] == k], alone, rtol=0,
                             atol=rounding_bound(packed[b][seg[b] == k], packed64[b][seg[b] == k]))
                total += alone.sum()
    assert_close(packed.sum(), total, rtol=0, atol=rounding_bound(packed.sum(), packed64.sum()))
    assert not torch.allclose(leaky.sum(), total, atol=1e-2)


def test_global_batch_is_the_same_for_dp_1_2_4(tmp_path):
    for packing in (True, False):
        cfg = mixed_config(tmp_path, packing=packing)
        ref, state, _ = global_batches(cfg, dp=1, mbs=1, gbs=8, steps=3)
        assert_same(global_batches(cfg, dp=2, mbs=2, gbs=8, steps=3)[0], ref)
        assert_same(global_batches(cfg, dp=4, mbs=1, gbs=8, steps=3)[0], ref)
        assert not torch.equal(ref[0][0].input_ids, ref[1][0].input_ids)


def test_exact_resume_also_with_another_dp_size(tmp_path):
    for packing in (True, False):
        cfg = mixed_config(tmp_path, packing=packing, eval_split=3)
        ref, _, ref_report = global_batches(cfg, dp=1, mbs=2, gbs=8, steps=7)
        first, state, _ = global_batches(cfg, dp=2, mbs=2, gbs=8, steps=3)
        assert state["step"] == 3 and (state["packer"]["open"] or not packing)
        rest, _, report = global_batches(cfg, dp=4, mbs=1, gbs=8, steps=4, state=state)
        assert_same(first + rest, ref)
        assert report.counts == ref_report.counts and report.counts and report.documents == ref_report.documents
    with pytest.raises(DataError, match="different data config"):
        global_batches(mixed_config(tmp_path, seq_len=64), dp=1, mbs=1, gbs=8, steps=1, state=state)


def test_eval_split_and_eval_sources(tmp_path):
    """The eval split is `datasets`' train_test_split test set (same seed, same records, same order), read once as
    eval batches; training, in file order without shuffle, reads the other records only, epoch after epoch."""
    import datasets

    tok = char_tokenizer()
    path = str(write_jsonl(tmp_path / "r.jsonl", RECORDS))
    layout = dict(dp_size=2, micro_batch_size=1, global_batch_size=4)

    def firsts(batches):  # the instruction text of each row's first document
        return ["".join(tok.convert_ids_to_tokens(m.input_ids[0][m.segment_ids[0] == 1].tolist()))
                .split("\n")[1] for b in batches for m in b.microbatches if m.segment_ids[0].max() > 0]

    split = datasets.Dataset.from_list(RECORDS).train_test_split(test_size=3, seed=4)
    held = [r["instruction"] for r in split["test"]]
    trained = [r["instruction"] for r in RECORDS if r["instruction"] not in held]
    cfg = DataConfig(sources=[SourceConfig(path)], seq_len=64, packing=False, eval_split=3, seed=4, shuffle=False)
    evals = [list(build_eval_data(cfg, tok, dp_rank=r, **layout)) for r in range(2)]
    assert [len(e) for e in evals] == [1, 1]  # 3 rows + 1 empty row, as 1 global batch
    assert firsts([evals[0][0], evals[1][0]]) == held
    assert evals[1][0].microbatches[1].segment_ids.max() == 0
    data = [build_data(cfg, tok, dp_rank=r, **layout) for r in range(2)]
    train = [next(d) for _ in range(2) for d in data]
    assert firsts(train) == trained + trained[:4]  # 4 training records, then the second epoch
    assert data[0].epoch == 2.0 and data[0].split == [(path, 4, 3)]
    # a fraction rounds up as datasets' does; more than half is refused in one line naming the source
    assert next(build_data(replace(cfg, eval_split=0.3), tok, dp_rank=0, **layout)) is not None
    assert len(list(Source(SourceConfig(path), eval_split=0.3).held_out())) == 3
    with pytest.raises(DataError, match=f"data source {path}: data.eval_split 4 holds out 4 of its 7 records"):
        next(build_data(replace(cfg, eval_split=4), tok, dp_rank=0, **layout))
    with pytest.raises(DataError, match="data.eval_split and data.eval_sources both"):
        DataConfig(sources=[SourceConfig(path)], eval_sources=[SourceConfig(path)], eval_split=2)
    cfg = DataConfig(sources=[SourceConfig(path)], eval_sources=[SourceConfig(path)], seq_len=300)
    (batch,) = build_eval_data(cfg, tok, dp_rank=0, dp_size=1, micro_batch_size=4, global_batch_size=4)
    assert batch.microbatches[0].segment_ids[0].max() == 7 and batch.num_tokens == 7 * 3


def test_llama2_tokenizer_on_the_projects_own_sft_sample():
    tok = llama2_or_skip()
    cfg = DataConfig(sources=[SourceConfig(str(OWN / "sft_sample.jsonl"))], seq_len=256, shuffle=False)
    batch = next(build_data(cfg, tok, dp_rank=0, dp_size=1, micro_batch_size=2, global_batch_size=2))
    records = [json.loads(line) for line in (OWN / "sft_sample.jsonl").read_text().splitlines()]
    k = 0
    for m in batch.microbatches:
        for ids, labels, seg in zip(m.input_ids, m.labels, m.segment_ids):
            for s in range(1, int(seg.max()) + 1):
                targets = labels[seg == s]
                assert tok.decode(targets[targets != -100]) == records[k]["output"] + "</s>"
                assert ids[seg == s][0] == tok.bos_token_id
                k += 1
    assert k >= 4 and batch.num_tokens == sum(m.label_tokens() for m in batch.microbatches)


def test_cp_ranks_hold_only_their_chunks_and_resume_at_another_cp(tmp_path):
    """Each CP rank gets chunks r and 2cp-1-r of every row (seq_len / cp tokens) and the rows' document ids;
    together they are the CP 1 rows, num_tokens is the global batch's, and the data state resumes at any CP size."""
    cfg = mixed_config(tmp_path, seq_len=64)
    tok = char_tokenizer()
    layout = dict(dp_rank=0, dp_size=1, micro_batch_size=2, global_batch_size=4)
    ref = [next(d) for d in [build_data(cfg, tok, **layout)] for _ in range(3)]
    state = None
    for cp, steps in ((2, range(2)), (4, range(2, 3))):
        ranks = [build_data(cfg, tok, cp_rank=r, cp_size=cp, **layout) for r in range(cp)]
        if state is not None:
            for d in ranks:
                d.load_state_dict(json.loads(json.dumps(state)))
        for step in steps:
            batches = [next(d) for d in ranks]
            assert {b.num_tokens for b in batches} == {ref[step].num_tokens}
            for m, whole in enumerate(ref[step].microbatches):
                for k in KEYS:
                    rebuilt = torch.empty_like(getattr(whole, k))
                    for r, b in enumerate(batches):
                        assert b.microbatches[m].shape == (2, 64 // cp)
                        rebuilt[:, token_index(64, cp, r)] = getattr(b.microbatches[m], k)
                    assert torch.equal(rebuilt, getattr(whole, k)), (cp, step, k)
                # and every CP rank holds the whole rows' document ids, for the keys of its attention mask
                assert all(torch.equal(b.microbatches[m].row_segment_ids, whole.segment_ids) for b in batches)
        state = ranks[0].state_dict()
    assert token_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]  # chunks 0 and 3 of 4
    assert token_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_bad_records_in_the_eval_split_are_counted_like_training_ones(tmp_path):
    """A malformed record among the held-out ones is reported by the training stream, eval on or off, once; with
    bad_data: fail it stops the run as a training record would."""
    tok = char_tokenizer()
    path = str(write_jsonl(tmp_path / "r.jsonl", [RECORDS[0], '{"instruction": "broken"', *RECORDS[1:]]))
    layout = dict(dp_rank=0, dp_size=1, micro_batch_size=1, global_batch_size=2)
    cfg = DataConfig(sources=[SourceConfig(path)], seq_len=64, packing=False, eval_split=3, seed=1)  # 5, 0, 1
    data = build_data(cfg, tok, **layout)
    next(data)
    assert data.report.counts == {"malformed_json": 1}
    assert data.report.first["malformed_json"].startswith(f"{path}:2: ")
    assert data.report.first["malformed_json"].endswith("(eval split)")
    assert data.report.documents == 2  # only the training rows' documents are packed
    evals = build_eval_data(cfg, tok, **layout)
    list(evals)  # eval meets the same record, counted in its own pass's report, not announced again
    assert evals.report.counts == {"malformed_json": 1} and not evals.report.announce
    with pytest.raises(DataError, match=f"{path}:2: .*eval split"):
        next(build_data(replace(cfg, bad_data="fail"), tok, **layout))


def test_microbatch_checks_its_shapes_and_splits_every_field_by_its_kind():
    """`MicroBatch` (data/microbatch.py): a tensor of the wrong shape is refused by name; `shard` cuts the
    per-token fields to the CP rank's chunks, makes positions, keeps the whole rows' document ids; a subclass
    with its own fields (a preference batch's pair index per row) is split and moved with no new code."""
    from dataclasses import dataclass, field

    from hfmeg.data.microbatch import PER_ROW, PER_TOKEN, step_shape
    from hfmeg.errors import LayoutError

    ids = torch.arange(16).reshape(2, 8)
    labels = torch.full((2, 8), -100)
    labels[0, :3] = 1
    with pytest.raises(LayoutError, match="micro-batch labels: shape \\(2, 7\\)"):
        MicroBatch(input_ids=ids, labels=labels[:, 1:])
    with pytest.raises(LayoutError, match="row_segment_ids: 1 rows"):
        MicroBatch(input_ids=ids, labels=labels, row_segment_ids=ids[:1])
    seg = torch.tensor([[1] * 5 + [2] * 3, [1] * 8])
    whole = MicroBatch(input_ids=ids, labels=labels, segment_ids=seg)
    assert whole.label_tokens() == 3 and whole.shard(0, 1) is whole
    with pytest.raises(LayoutError, match="same \\[batch, seq\\] shape"):
        step_shape([whole, MicroBatch(input_ids=ids[:1], labels=labels[:1])])

    @dataclass(frozen=True, kw_only=True)
    class Pairs(MicroBatch):
        pair_index: torch.Tensor = field(metadata=PER_ROW)
        document_pair: torch.Tensor = field(metadata=PER_TOKEN)

    pairs = Pairs(input_ids=ids, labels=labels, segment_ids=seg, pair_index=torch.tensor([0, 0]),
                  document_pair=seg - 1)
    for r in range(2):
        cols = token_index(8, 2, r)
        for mb in (whole.shard(r, 2), pairs.shard(r, 2).to(torch.device("cpu"))):
            assert mb.shape == (2, 4) and torch.equal(mb.input_ids, ids[:, cols])
            assert torch.equal(mb.position_ids, cols.expand(2, 4)) and torch.equal(mb.segment_ids, seg[:, cols])
            assert torch.equal(mb.row_segment_ids, seg)
        assert type(mb) is Pairs and torch.equal(mb.pair_index, pairs.pair_index)
        assert torch.equal(mb.document_pair, (seg - 1)[:, cols])
