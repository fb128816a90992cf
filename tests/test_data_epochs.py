"""The eval split and the epochs: held-out records are never trained on, each epoch is a new seeded order of the
training records, the same for every layout and across a resume; `train.num_epochs` stops the run."""

from __future__ import annotations

import json

import pytest

from bounds import within
from hfmeg.data import DataConfig, SourceConfig, build_data
from hfmeg.data.sources import Source
from hfmeg.errors import DataError
from hfmeg.parallel.launch import spawn
from hfmeg.train.metrics import read_metrics
from test_data import char_tokenizer, write_jsonl
from test_data_batches import assert_same, global_batches
from test_train import ALPACA, _assets, _config, _losses, _run

NAMES = [f"q{i}" for i in range(20)]
BAD = ['{"instruction": "broken"', "[1, 2]"]  # two malformed records among them


def small_file(tmp_path):
    recs = [{"instruction": n, "input": "", "output": "a" + n} for n in NAMES]
    return str(write_jsonl(tmp_path / "small.jsonl", recs[:7] + BAD[:1] + recs[7:15] + BAD[1:] + recs[15:]))


def names(batch) -> list[str]:
    """The instruction of each row's document (rows of one document: packing off), '' for an empty row."""
    tok = char_tokenizer()
    out = []
    for m in batch.microbatches:
        for ids, seg in zip(m.input_ids, m.segment_ids):
            text = "".join(tok.convert_ids_to_tokens(ids[seg == 1].tolist()))
            out.append(text.split("\n")[1] if text else "")
    return out


def test_held_out_records_are_never_trained_on_and_every_epoch_is_a_new_order(tmp_path):
    """Four epochs of a 22-record file (2 malformed) with a quarter held out: the held-out records are datasets'
    train_test_split test set and never appear in a training row; each epoch is every training record once, in an
    order of its own; the malformed records are counted once each, not once per epoch."""
    import datasets

    path = small_file(tmp_path)
    cfg = DataConfig(sources=[SourceConfig(path)], seq_len=64, packing=False, eval_split=0.25, seed=3)
    held = [r.record["instruction"] if r.record else None for r in Source(SourceConfig(path), seed=3,
                                                                          eval_split=0.25).held_out()]
    lines = [json.loads(x) if x.startswith("{\"instruction\": \"q") else None
             for x in open(path).read().splitlines()]
    expect = datasets.Dataset.from_list([{"i": i} for i in range(len(lines))]).train_test_split(test_size=0.25, seed=3)
    assert held == [lines[r["i"]]["instruction"] if lines[r["i"]] else None for r in expect["test"]]
    assert len(held) == 6  # ceil(0.25 * 22), as datasets rounds
    trained_set = set(NAMES) - set(held)
    data = build_data(cfg, char_tokenizer(), dp_rank=0, dp_size=1, micro_batch_size=1, global_batch_size=2)
    rows = []
    while data.epoch < 4:
        rows += names(next(data))
    assert data.epoch == 4.0 and data.split == [(path, 16, 6)]
    good = len(trained_set)
    assert len(rows) == 4 * good  # the training records that are not malformed, each epoch
    epochs = [rows[e * good:(e + 1) * good] for e in range(4)]
    assert all(sorted(e) == sorted(trained_set) for e in epochs)  # every training record once an epoch
    assert not set(rows) & set(held)  # no held-out record in any training row
    assert len({tuple(e) for e in epochs}) == 4  # a new order every epoch
    assert sum(data.report.counts.values()) == 2 and data.report.counts == {"malformed_json": 2}


def test_shuffled_epochs_are_the_same_for_every_dp_layout_and_across_a_resume(tmp_path):
    cfg = DataConfig(sources=[SourceConfig(small_file(tmp_path))], seq_len=64, read_ahead=3, eval_split=4)
    ref, _, ref_report = global_batches(cfg, dp=1, mbs=2, gbs=8, steps=9)  # several epochs of 16 records
    first, state, _ = global_batches(cfg, dp=2, mbs=2, gbs=8, steps=4)
    assert state["position"]["epochs"][0] >= 1  # the resume point lies past the first epoch
    rest, _, report = global_batches(cfg, dp=4, mbs=1, gbs=8, steps=5, state=state)
    assert_same(first + rest, ref)
    assert report.counts == ref_report.counts == {"malformed_json": 2}


def test_a_hub_stream_holds_out_its_first_records_and_shuffles_through_the_buffer(monkeypatch):
    """A streamed dataset: the first eval_split records are held out; each epoch reads the others through datasets'
    shuffle buffer, seeded per epoch, and `records(epoch, start)` resumes inside an epoch."""
    import datasets

    recs = [{"instruction": n, "input": "", "output": "a" + n} for n in NAMES]
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_list(recs).to_iterable_dataset(
        num_shards=4))
    src = Source(SourceConfig("org/set"), seed=1, eval_split=3, shuffle=True, shuffle_buffer=5)
    assert [r.record["instruction"] for r in src.held_out()] == NAMES[:3]
    epochs = [[r.record["instruction"] for r in src.records(e)] for e in range(2)]
    assert all(sorted(e) == sorted(NAMES[3:]) for e in epochs) and epochs[0] != epochs[1]
    assert epochs[0] != NAMES[3:]
    assert [r.record["instruction"] for r in src.records(1, 7)] == epochs[1][7:]
    with pytest.raises(DataError, match="org/set.*no length to take a fraction of"):
        list(Source(SourceConfig("org/set"), eval_split=0.1).held_out())


def _alpaca_head(tmp_path, n=20):
    recs = json.loads(ALPACA.read_text())[:n]
    return str(write_jsonl(tmp_path / "head.jsonl", recs))


def _epochs(out) -> list[float]:
    return [r["epoch"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def test_num_epochs_stops_the_run_the_same_for_tp2_pp2_and_one_process_and_across_a_resume(tmp_path):
    """Two epochs of 16 training records (alpaca's first 20, 4 held out, 4 rows a step): the run stops at the first
    step that completes them; one process and TP2 x PP2 take the same steps with the same losses; a run stopped after
    3 steps and resumed takes them too."""
    model = _assets()
    data = _alpaca_head(tmp_path)

    def config(out, **kw):
        cfg = _config(out, model, steps=kw.pop("steps", 100), gbs=4, schedule_steps=12, eval_split=4, **kw)
        cfg.data.sources = [SourceConfig(data)]
        cfg.data.packing = False
        cfg.train.num_epochs = 2
        return cfg

    spawn(_run, 1, config(tmp_path / "single"))
    epochs = _epochs(tmp_path / "single")
    # records drawn (those dropped as too long at seq_len 64 included) over the 16 training records
    assert epochs == sorted(epochs) and epochs[-2] < 2 <= epochs[-1] and len(epochs) >= 4
    spawn(_run, 4, config(tmp_path / "grid", tp=2, pp=2))
    a, b = _losses(tmp_path / "single"), _losses(tmp_path / "grid")
    assert _epochs(tmp_path / "grid") == epochs
    # Every run in launch.spawn ranks, one thread each whatever OMP_NUM_THREADS or the load: no thread count moves
    # these losses (docs/testing.md, bounds). The layout contract's 1e-4: fp32 sums in other orders over the run's Adam steps.
    within(max(abs(x - y) / abs(x) for x, y in zip(a, b)), 1e-4, "1 process vs TP2xPP2 loss rel", (a, b))
    spawn(_run, 1, config(tmp_path / "split", steps=3))
    spawn(_run, 1, config(tmp_path / "split", resume="auto"))
    assert _losses(tmp_path / "split") == a and _epochs(tmp_path / "split") == epochs
